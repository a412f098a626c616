"""Decision cost of ``prefix-hrw`` (the default policy) against ``weighted-hrw``.

One ``choose`` per call, including the prefix hashing of a 16 kB prompt and the policy's
share-estimate update (``on_routed``), over fleets of 100, 1,000 and 10,000 equal engines
with random in-flight token loads. Four prompt shapes:

``unique``     nothing shared: the first depth key decides;
``hot``        a 2 kB system prompt shared by every request, then one of 64
               conversations: the hot depths are skipped, the conversation decides;
``hot-overload``  as ``hot`` with every conversation's home over its load bound, so
               every candidate is ranked and the bounded fallback decides (worst case);
``idle``       as ``hot`` on an idle fleet (no tokens in flight).
``mixed``      as ``hot`` on engines of two prefill speeds (every other one 2.5x slower:
               ``prefill_cost``) with every home's queue longer than any saving, so that
               every decision weighs the cost spill in prefill time, one pass over the
               fleet (its worst case).

Run::

    .venv/bin/python bench/bench_prefix_pick.py [--engines 100 1000 10000] [--calls 2000]
        [--shapes unique hot hot-overload idle] [--workers 4]

``--workers W`` (default 4; 1 leaves the column out) also times the policy with the host's
key log attached, as a worker of ``W`` reads it: before each round the other ``W - 1``
workers' entries for the round's requests are published (untimed), so that each of the
round's decisions drains ``W - 1`` entries on average into the tables and publishes its
own (the drain and publish are the log's whole request-path cost); it then times the replay
of a full 4096-entry log by a fresh policy (a worker that starts or reloads), once per round
of 3.

Reports the minimum and median over rounds of the mean µs per call (scheduling noise
only adds time, so the minimum is the cost; the median shows the noise), the minimum CPU
µs per call (``time.process_time``: what other processes' load does not add), and the
ratio to ``weighted-hrw``'s ``choose`` measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from fastroute.hashing import engine_id
from fastroute.policy import RouteRequest, StaticFleetView, make_policy
from fastroute.policy.prefix_hrw import private_key_log

PROMPT_BYTES = 16 * 1024
SHAPES = ("unique", "hot", "hot-overload", "idle", "mixed")


def _view(n: int, rng: np.random.Generator) -> StaticFleetView:
    view = StaticFleetView([engine_id(f"e{i}") for i in range(n)], np.ones((1, n)))
    view.token_loads[:] = rng.integers(1000, 5000, size=n)
    view.loads[:] = rng.integers(1, 10, size=n)
    return view


def _requests(shape: str, count: int, rng: np.random.Generator) -> list[RouteRequest]:
    system = bytes(rng.integers(97, 123, size=2048, dtype=np.uint8))
    out = []
    for i in range(count):
        if shape == "unique":
            body = bytes(rng.integers(97, 123, size=PROMPT_BYTES, dtype=np.uint8))
        else:
            conv = np.random.default_rng(i % 64).integers(97, 123, size=PROMPT_BYTES - 2048)
            body = system + bytes(conv.astype(np.uint8))
        out.append(
            RouteRequest(
                key_hash=int(rng.integers(0, 2**63)),
                row=0,
                prompt_tokens=PROMPT_BYTES // 4,
                prefix=body,
                expected_output_tokens=200,
            )
        )
    return out


def _time(policy, view, requests, rounds: int, cpu: list[float] | None = None) -> list[float]:
    ids = [int(x) for x in view.selector.engine_ids]
    means = []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        for request in requests:
            decision = policy.choose(request, view)
            policy.on_routed(request, ids[decision.ranked[0]])
        means.append((time.perf_counter() - t0) / len(requests) * 1e6)
        if cpu is not None:
            cpu.append((time.process_time() - c0) / len(requests) * 1e6)
    return means


def _time_shared(policy, view, requests, rounds: int, workers: int) -> list[float]:
    """As :func:`_time`, ``policy`` reading a key log the other ``workers - 1`` filled."""
    others = [make_policy("prefix-hrw") for _ in range(workers - 1)]
    capacity = 1 << max(4, ((workers - 1) * len(requests)).bit_length())
    log = private_key_log(capacity)
    policy.attach_key_log(log, 0, 0)
    writers = [other.attach_key_log(log, w + 1, 0) for w, other in enumerate(others)]
    keys = [[key for _, key in policy.keys(r)] for r in requests]
    means = []
    for _ in range(rounds):
        for writer in writers:
            for request_keys in keys:
                writer.publish(request_keys, 2)
        means += _time(policy, view, requests, 1)
    return means


def _replay_ms(entries: int = 4096, rounds: int = 3) -> list[float]:
    """Milliseconds a fresh policy takes to attach a full log of ``entries`` requests of 8
    unique keys each (the replay of a worker that starts or reloads), per round."""
    rng = np.random.default_rng(2)
    log = private_key_log(entries)
    writer = make_policy("prefix-hrw").attach_key_log(log, 1, 0)
    for _ in range(entries):
        writer.publish([int(x) for x in rng.integers(0, 2**63, size=8)], 3)
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        make_policy("prefix-hrw").attach_key_log(log, 2, 0)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _overload(view: StaticFleetView, policy, requests) -> None:
    """Put every candidate home of the requests over its bound."""
    for request in requests[:256]:
        for _, key in policy.keys(request):
            view.token_loads[view.selector.pick(key, 0)] = 10**9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    shared = f" with a {args.workers}-worker key log min µs |" if args.workers > 1 else ""
    print(
        "| engines | prompts | prefix-hrw min / median µs | prefix-hrw CPU µs "
        f"| weighted-hrw min µs | ratio (min) |{shared}"
    )
    print("|---|---|---|---|---|---|" + ("---|" if shared else ""))
    for n in args.engines:
        for shape in args.shapes:
            rng = np.random.default_rng(1)
            view = _view(n, rng)
            requests = _requests("unique" if shape == "unique" else "hot", args.calls, rng)
            policy = make_policy("prefix-hrw")
            _time(policy, view, requests, 1)  # warm the share estimate: hot groups known
            if shape == "hot-overload":
                _overload(view, policy, requests)
            elif shape == "idle":
                view.token_loads[:] = 0
                view.loads[:] = 0
            elif shape == "mixed":
                view.prefill_costs = np.where(np.arange(n) % 2, 2.5, 1.0)
                view.token_loads[:] = rng.integers(20_000, 50_000, size=n)
            cpu: list[float] = []
            ours = _time(policy, view, requests, args.rounds, cpu)
            base = _time(make_policy("weighted-hrw"), view, requests, args.rounds)
            cell = ""
            if shared:
                cell = (
                    f" {min(_time_shared(policy, view, requests, args.rounds, args.workers)):.1f} |"
                )
            print(
                f"| {n} | {shape} | {min(ours):.1f} / {statistics.median(ours):.1f} | "
                f"{min(cpu):.1f} | {min(base):.1f} | {min(ours) / min(base):.1f}× |{cell}"
            )
    if shared:
        replay = ", ".join(f"{ms:.1f}" for ms in _replay_ms())
        print(f"\nattaching a full 4096-entry key log (a worker's replay at start): {replay} ms")


if __name__ == "__main__":
    main()
