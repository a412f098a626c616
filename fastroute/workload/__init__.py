"""Workloads shared by the simulator, the emulated-fleet benchmark and the demo.

* :mod:`fastroute.workload.spec` — :class:`ChatWorkload` and its parts (TOML-decodable);
* :mod:`fastroute.workload.session` — :class:`Session` / :class:`Turn` and prompt text;
* :mod:`fastroute.workload.generate` — :func:`generate_sessions` (multi-turn chat);
* :mod:`fastroute.workload.trace` — :func:`load_trace` (Azure CSV, Mooncake JSONL, generic);
* :mod:`fastroute.workload.mix` — :class:`ReplayMix`, bursty mixes of several traces;
* :mod:`fastroute.workload.families` — workload family specs (``[family]``: chat,
  prefix-tree, rag, agentic, long-tail, hot-prompt) and
  :mod:`fastroute.workload.family_gen` — their sessions (:func:`family_sessions`);
* :mod:`fastroute.workload.blocks` — shared block text derived from block ids.
"""

from fastroute.workload.generate import generate_sessions
from fastroute.workload.session import Session, SessionPrompts, Turn
from fastroute.workload.spec import (
    Burst,
    ChatWorkload,
    Diurnal,
    LogNormal,
    TenantMix,
    Weighted,
    WorkloadError,
)
from fastroute.workload.trace import load_trace

__all__ = [
    "Burst",
    "ChatWorkload",
    "Diurnal",
    "LogNormal",
    "Session",
    "SessionPrompts",
    "TenantMix",
    "Turn",
    "Weighted",
    "WorkloadError",
    "generate_sessions",
    "load_trace",
]
