"""Step-time constants fitted to real engines (not derived from datasheets).

:mod:`fastroute.hardware` derives every GPU profile from datasheet figures and stated
efficiency factors; the constants here are instead *measured*: fitted by
``bench/calibrate_real_vllm.py`` (relative NNLS, :func:`fastroute.predict.fit.fit_step_times`)
to a real engine's own timings. docs/predict.md ("Fit on a real vLLM") gives the points, the
residuals and the command; the raw results are in ``docs/history/``.

Nothing uses them by default. A fleet of such engines starts its calibration from them
with ``FleetCalibration(nominal={"cpu-tiny-llama-vllm": MEASURED["cpu-tiny-llama-vllm"]})``
and types its engines ``cpu-tiny-llama-vllm``.
"""

from __future__ import annotations

from fastroute.predict.step_time import NominalStepTimes

__all__ = ["MEASURED"]

#: Measured step-time constants by engine type.
#:
#: ``cpu-tiny-llama-vllm``: vLLM 0.32.0 (V1, CPU build, ``--enforce-eager --dtype float32``,
#: ``--max-num-seqs 16``, one OpenMP thread pinned to one core of a shared 2-core machine)
#: serving a random-weight 6-layer Llama (d = 288, 15 M parameters with its 32 000 × 288
#: embedding), fitted to vLLM's own ``request_prefill_time`` and ``request_decode_time``
#: histograms, minimum of 7 interleaved repeats per point. a3 (attention of new tokens
#: to a cached prefix or to earlier chunks) is not excited by prompts that fit one step:
#: it is 2·a2, the mechanism's ratio (the same pairs as causal attention, without the
#: mask that halves them; :mod:`fastroute.hardware`), which a run with 256-token chunks
#: agrees with to its noise. m1 is the nominal a1 (no interleaving measured per request).
MEASURED: dict[str, NominalStepTimes] = {
    "cpu-tiny-llama-vllm": NominalStepTimes(
        a0_s=19.5e-3,
        a1_s=0.201e-3,
        a2_s=7.1e-8,
        a3_s=2 * 7.1e-8,
        b0_s=19.6e-3,
        b1_s=1.33e-3,
        b2_s=3.61e-6,
        max_num_batched_tokens=2048,
    ),
}
