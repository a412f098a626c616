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
#: Re-fitted 2026-12-03 on the machine the CI now runs on (load average 0.9 -> 2.8): the
#: constants fitted on the earlier host (a0 19.5 ms, a1 0.201 ms, a2 7.1e-8, b0 19.6 ms, b1
#: 1.33 ms, b2 3.61e-6) left a shape error of 27-33 % here (its per-step overheads are half,
#: its quadratic prefill term 1.7x): hosts differ in the shape, not only in speed
#: (docs/predict.md, "Fit on a real vLLM"; raw results in docs/history/).
MEASURED: dict[str, NominalStepTimes] = {
    "cpu-tiny-llama-vllm": NominalStepTimes(
        a0_s=12.0e-3,
        a1_s=0.173e-3,
        a2_s=1.19e-7,
        a3_s=2 * 1.19e-7,
        b0_s=9.52e-3,
        b1_s=0.885e-3,
        b2_s=2.22e-6,
        max_num_batched_tokens=2048,
    ),
}
