"""Engine emulator: vLLM-compatible fake engines driven by a real performance model.

* :mod:`~fastroute.emulator.model` — the engine performance model (continuous
  batching, chunked prefill, paged KV cache with prefix caching, preemption,
  calibrated step times, P/D KV transfer). No I/O, clock injected; the simulator
  uses it too.
* :mod:`~fastroute.emulator.profiles` — the *true* step times: a datasheet profile
  (:mod:`fastroute.hardware`) scaled by per-coefficient factors.
* :mod:`~fastroute.emulator.output_text` — the generated text (the tokenizer
  approximation and chat template are :mod:`fastroute.tokens`).
* :mod:`~fastroute.emulator.server` — the aiohttp server (OpenAI API, SSE, vLLM
  metrics, P/D protocol) and :class:`EmulatedFleet` for tests and benchmarks.
* :mod:`~fastroute.emulator.faults` — fault injection.

This package imports no aiohttp at import time; import
:mod:`fastroute.emulator.server` for the server side. See ``docs/emulator.md``.
"""

from fastroute.emulator.model import (
    EngineConfig,
    EngineModel,
    OutputLengthDistribution,
    Phase,
    QueueFullError,
    Request,
    RequestTooLongError,
    StepResult,
    replay,
)

__all__ = [
    "EngineConfig",
    "EngineModel",
    "OutputLengthDistribution",
    "Phase",
    "QueueFullError",
    "Request",
    "RequestTooLongError",
    "StepResult",
    "replay",
]
