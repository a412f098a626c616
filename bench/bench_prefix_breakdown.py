"""Where a ``prefix-hrw`` decision's time goes, part by part (CPU µs per call).

Times the parts of one decision on a fleet of equal engines with random in-flight token
loads and a 16 kB prompt: the depth hashing, the flat rendezvous calls the policy made
before the trie (``rank``, ``rank_prefix``, ``least_loaded``), the trie's calls when the
tree has them (``tree_rank``, ``tree_rank_prefix``, ``tree_least_loaded``), the compiled
picker's ``choose``, the policy's ``choose`` + ``on_routed`` and ``weighted-hrw``'s
``choose``. The minimum over 5 rounds of ``time.process_time`` per call. Runs on any tree
(``PYTHONPATH=<tree>``), so before and after can be compared::

    PYTHONPATH=<tree> .venv/bin/python bench/bench_prefix_breakdown.py 100 10000
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from fastroute._core import PrefixPicker
from fastroute.hashing import engine_id
from fastroute.policy import RouteRequest, StaticFleetView, make_policy


def _cpu_us(fn: Callable[[], object], reps: int) -> float:
    best = float("inf")
    for _ in range(5):
        c0 = time.process_time()
        for _ in range(reps):
            fn()
        best = min(best, (time.process_time() - c0) / reps * 1e6)
    return best


def _parts(n: int) -> dict[str, Callable[[], object]]:
    rng = np.random.default_rng(1)
    view = StaticFleetView([engine_id(f"e{i}") for i in range(n)], np.ones((1, n)))
    view.token_loads[:] = rng.integers(1000, 5000, size=n)
    sel, mask, loads = view.selector, view.eligible(0), view.token_loads
    prefix = bytes(rng.integers(97, 123, size=16384, dtype=np.uint8))
    req = RouteRequest(12345, 0, 4096, prefix, 200)
    picker = PrefixPicker(512, 32768, 2.0, 0.5, 1024.0)
    policy, whrw = make_policy("prefix-hrw"), make_policy("weighted-hrw")
    keys = [h for _, h in picker.keys(prefix, 12345, -1)]
    parts: dict[str, Callable[[], object]] = {
        "depth hashing (keys)": lambda: picker.keys(prefix, 12345, -1),
        "flat rank k=3": lambda: sel.rank(keys[0], 0, 3, mask),
        "flat rank_prefix, 1 key (ranking + totals)": lambda: sel.rank_prefix(
            keys[:1], 0, 3, loads, 2.0, mask
        ),
        "flat least_loaded": lambda: sel.least_loaded(keys[-1], 0, loads, mask),
    }
    if hasattr(sel, "tree_rank"):
        parts["tree_rank k=1"] = lambda: sel.tree_rank(keys[0], 0, 1, mask)
        parts["tree_rank k=3"] = lambda: sel.tree_rank(keys[0], 0, 3, mask)
        parts["tree_rank_prefix, 1 key"] = lambda: sel.tree_rank_prefix(
            keys[:1], 0, 3, loads, 2.0, mask
        )
        parts["tree_least_loaded"] = lambda: sel.tree_least_loaded(keys[-1], 0, loads, mask)
    parts["picker.choose"] = lambda: picker.choose(sel, req, mask, loads, 3)
    parts["policy choose + on_routed"] = lambda: (
        policy.choose(req, view),
        policy.on_routed(req, 0),
    )
    parts["weighted-hrw choose"] = lambda: whrw.choose(req, view)
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engines", type=int, nargs="*", default=[100, 10000])
    parser.add_argument("--reps", type=int, default=2000)
    args = parser.parse_args()
    print("| engines | part | CPU µs |")
    print("|---|---|---|")
    for n in args.engines:
        for name, fn in _parts(n).items():
            print(f"| {n} | {name} | {_cpu_us(fn, args.reps):.2f} |")


if __name__ == "__main__":
    main()
