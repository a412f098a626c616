"""CPU time per chunk of the relay's splice callback on a stream that may be migrated (a
script): the happy path's cost of the drain hand-off check.

Compare two trees side by side, e.g. ``for t in /work/main /work/wt/drain; do
PYTHONPATH=$t .venv/bin/python bench/bench_drain_check.py; done``
(the script runs whatever ``fastroute`` the path gives; a tree without the check skips it).
"""

from __future__ import annotations

import time

from fastroute.proxy.path.migration import Migration
from fastroute.proxy.path.relay import _StreamTally
from fastroute.proxy.path.sse import StreamMeter

N_CHUNKS = 200_000
REPEATS = 7
EVENT = b'data: {"id":"x","choices":[{"index":0,"delta":{"content":" word"}}]}\n\n'


class _Splice:
    def write_now(self, data: bytes, last: bool = False) -> bool:
        return True


def per_chunk_ns() -> float:
    """Best of :data:`REPEATS` runs of :data:`N_CHUNKS` chunks, CPU ns per chunk."""
    best = float("inf")
    for _ in range(REPEATS):
        tally = _StreamTally(StreamMeter(False), None, lambda now: None, Migration(b"{}", 1 << 40))
        tally.splice = _Splice()  # type: ignore[assignment]
        if hasattr(tally, "handoff_at"):  # an engine that is not draining
            tally.handoff_at, tally.index = [float("inf")] * 4, 1
            tally.on_drain = lambda: False
        t0 = time.process_time()
        for i in range(N_CHUNKS):
            tally.relay(EVENT, 1.0 + i, False)
        best = min(best, (time.process_time() - t0) / N_CHUNKS)
    return best * 1e9


if __name__ == "__main__":
    print(f"{per_chunk_ns():.1f} ns/chunk")
