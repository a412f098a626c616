"""Route the same prefix-sharing workloads through two real vLLM engines under each router.

    PYTHONPATH=. .venv/bin/python bench/real_routers.py --out bench-results/real-routers
    PYTHONPATH=. .venv/bin/python bench/real_routers.py --table DIR/results.json

Starts two CPU vLLM engines with the real tier's harness (``tests/real/real_harness.py``:
the tiny random-weight Llama, one core each) with a KV cache of ``--kv-tokens`` tokens each
and vLLM's prefix caching (its default), and, per run, one router in front of them:
``fastroute[:policy]`` is one ``fastroute serve`` (one worker, no controller: equal
weights) with ``[policy] default`` set to the policy; ``sglang:<policy>`` and
``vllm-router:<policy>`` are the peers as the fleet benchmark starts them
(:mod:`fastroute.fleetbench.routers`). A router is ready when a chat request through it
answers 200. The client is the official ``openai`` client, streaming chat completions.
Every run of a workload replays the same seeded requests at the same times; before each run
both engines' prefix caches are emptied (vLLM's dev endpoint ``/reset_prefix_cache``), so
no router inherits another's cache. The routers' order rotates between repeats.

Workloads (prompt lengths in the tiny tokenizer's tokens, measured with the engine's
``/tokenize``):

* ``rag``: ``--documents`` documents (55) of ~700 tokens, each request one of them (Zipf 0.6
  popularity) then a ~25-token question, open loop (Poisson, ``--rag-rate-rps``). The
  documents together (~38 k tokens) exceed one engine's KV cache (``--kv-tokens``, 32 k,
  less what the running requests hold): an engine that sees every document cannot keep them
  all, two engines that split them can. This is what a cache-aware router buys on a real
  engine, and what round robin cannot.
* ``sessions``: agent sessions arriving open loop (Poisson, ``--session-rate-per-s``);
  each has a ~200-token task, then turns that append a ~150-token tool output to the
  history (with the model's own replies), until ~1700 tokens; the next turn is sent 0.3 s
  after the reply (closed loop within a session). A turn finds its history cached only on
  the engine of its last turn.

Before each run, three requests of unrelated text go straight to each engine (a run's
first steps on an engine are slower; every run starts on engines warmed alike) and then the
caches are emptied. Before a workload's first measured run, one unmeasured replay of it
goes through ``--warmup-router`` (round robin; kept in ``results.json`` as ``warmup``):
without it, in two `sessions`-only runs (2026-12-08), the run right after the engines
started was 0.11 and 0.21 in goodput below its router's other repeats, and the rotation
always puts the first listed router (the default) there.

The default SLOs: TTFT 1 s is about three uncached 800-token prefills of this model on
this machine; 0.1 s between tokens is several decode steps (20-50 ms) and less than one
uncached long prefill, which stalls the decodes beside it.

Reported per workload, router and repeat: goodput (share of requests with TTFT <=
``--ttft-slo-s`` and mean time between tokens <= ``--tbot-slo-s``; errors are misses), TTFT
p50 / p99, TBOT p99, the engines' own prefix-cache hit rate (``vllm:prefix_cache_hits_total``
over ``vllm:prefix_cache_queries_total``, tokens), requests per engine (max / min of
``vllm:request_success_total``) and the router's CPU per request (utime + stime of its
process session). Not a test: the numbers of docs/real-engines.md ("Routers on real
engines").
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from fastroute.fleetbench.process import wait_http_ok
from fastroute.fleetbench.procstat import session_cpu_s
from fastroute.fleetbench.routers import expand_command, resolve_router
from fastroute.fleetbench.scrape import EngineCounters, scrape_engines
from fastroute.loadgen.summary import percentile
from fastroute.testing.processes import free_port

ROOT = Path(__file__).resolve().parent.parent
#: The engines' context (the tiny model has 2048 positions).
MAX_MODEL_LEN = 2048
#: KV bytes per token of the tiny model: 6 layers x (K, V) x 6 heads x 48 x 4 bytes (fp32).
KV_BYTES_PER_TOKEN = 6 * 2 * 6 * 48 * 4
#: Output tokens of every request (``ignore_eos``): equal decode work under every policy.
OUTPUT_TOKENS = 32
#: Requests the client keeps in flight at most; an arrival past it is counted as a miss.
MAX_IN_FLIGHT = 128
#: After the last arrival, how long a run waits for its requests to end, seconds.
DRAIN_S = 90.0
#: The routers compared by default: fastroute's default, two of its other policies, and the
#: peers' (the fleet benchmark's names, :mod:`fastroute.fleetbench.routers`).
ROUTERS = (
    "fastroute", "fastroute:cache-aware", "fastroute:round-robin",
    "sglang:cache_aware", "vllm-router:cache_aware",
)  # fmt: skip
_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]


def harness() -> ModuleType:
    """The real tier's harness module (``tests/real`` is not a package)."""
    sys.path.insert(0, str(ROOT / "tests" / "real"))
    return importlib.import_module("real_harness")


# -- workloads -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Conversation:
    """Messages a client sends: a system prompt, then user turns, each after the reply to
    the one before (and ``think_s``); the first is sent at ``start_s``."""

    start_s: float
    system: str
    turns: tuple[str, ...]
    think_s: float = 0.3


class Words:
    """Seeded pseudo-words, the kind the tiny tokenizer was trained on."""

    def __init__(self, rng: random.Random, tokens_per_word: float = 1.0) -> None:
        self.rng = rng
        self.tokens_per_word = tokens_per_word
        self.vocabulary = [
            "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(5000)
        ]

    def text(self, tokens: int) -> str:
        """About ``tokens`` tokens of text."""
        n = max(1, round(tokens / self.tokens_per_word))
        return " ".join(self.rng.choice(self.vocabulary) for _ in range(n))


def rag(words: Words, rate_rps: float, duration_s: float, documents: int) -> list[Conversation]:
    """Single-turn questions on shared documents (Zipf 0.6), Poisson arrivals."""
    rng = words.rng
    docs = [words.text(rng.randint(600, 800)) for _ in range(documents)]
    popularity = [1.0 / (i + 1) ** 0.6 for i in range(documents)]
    system = "You answer questions about the document the user gives."
    out, t = [], rng.expovariate(rate_rps)
    while t < duration_s:
        doc = rng.choices(docs, popularity)[0]
        question = words.text(rng.randint(15, 35))
        out.append(Conversation(t, system, (f"Document:\n{doc}\n\nQuestion: {question}",)))
        t += rng.expovariate(rate_rps)
    return out


def sessions(words: Words, rate_per_s: float, duration_s: float) -> list[Conversation]:
    """Agent sessions whose context grows by ~150-token tool outputs up to ~1700 tokens."""
    rng = words.rng
    system = "You are an agent. Call tools until the task is done. " + words.text(40)
    out, t = [], rng.expovariate(rate_per_s)
    while t < duration_s:
        turns, context = [words.text(rng.randint(150, 250))], 250
        while context + 200 < 1700:
            turns.append("Tool output:\n" + words.text(rng.randint(100, 200)))
            context += 150 + OUTPUT_TOKENS
        out.append(Conversation(t, system, tuple(turns)))
        t += rng.expovariate(rate_per_s)
    return out


# -- one run ---------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One request's client-side timings (seconds); ``error`` is empty on success."""

    conversation: int
    turn: int
    sent_s: float = 0.0  # since the run's start
    engine: str = ""  # fastroute's x-fastroute-engine (peers do not say)
    decision: str = ""  # fastroute's x-fastroute-decision
    ttft_s: float = float("nan")
    tbot_s: float = float("nan")
    tokens: int = 0
    error: str = ""


@dataclass
class Client:
    """Replays conversations through a router with the official ``openai`` client."""

    base_url: str
    model: str
    outcomes: list[Outcome] = field(default_factory=list)
    in_flight: int = 0

    async def run(self, conversations: list[Conversation]) -> None:
        from openai import AsyncOpenAI

        api = AsyncOpenAI(base_url=self.base_url + "/v1", api_key="none", max_retries=0)
        start = time.monotonic()
        async with api:
            tasks = [
                asyncio.create_task(self._converse(api, start, i, c))
                for i, c in enumerate(conversations)
            ]
            await asyncio.wait_for(
                asyncio.gather(*tasks), conversations[-1].start_s + DRAIN_S if tasks else 1
            )

    async def _converse(self, api: Any, start: float, index: int, conv: Conversation) -> None:
        await asyncio.sleep(max(0.0, start + conv.start_s - time.monotonic()))
        messages: list[dict[str, str]] = [{"role": "system", "content": conv.system}]
        for turn, text in enumerate(conv.turns):
            messages.append({"role": "user", "content": text})
            outcome, reply = await self._request(api, index, turn, messages)
            outcome.sent_s -= start
            self.outcomes.append(outcome)
            if outcome.error:
                return  # a session that lost a turn ends (its next turns are not sent)
            messages.append({"role": "assistant", "content": reply})
            await asyncio.sleep(conv.think_s)

    async def _request(
        self, api: Any, index: int, turn: int, messages: list[dict[str, str]]
    ) -> tuple[Outcome, str]:
        outcome = Outcome(index, turn)
        if self.in_flight >= MAX_IN_FLIGHT:
            outcome.error = "client in-flight cap"
            return outcome, ""
        self.in_flight += 1
        sent, stamps, parts = time.monotonic(), [], []
        outcome.sent_s = sent
        try:
            raw = await api.chat.completions.with_raw_response.create(
                model=self.model, messages=messages, max_tokens=OUTPUT_TOKENS, stream=True,
                extra_body={"ignore_eos": True}, timeout=60.0,
            )  # fmt: skip
            outcome.engine = raw.headers.get("x-fastroute-engine", "")
            outcome.decision = raw.headers.get("x-fastroute-decision", "")
            async for chunk in raw.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    stamps.append(time.monotonic())
                    parts.append(chunk.choices[0].delta.content)
        except Exception as exc:  # every failure is a miss, with its kind
            outcome.error = f"{type(exc).__name__}: {exc}"[:200]
        finally:
            self.in_flight -= 1
        if stamps:
            outcome.ttft_s = stamps[0] - sent
            outcome.tokens = len(stamps)
            if len(stamps) > 1:
                outcome.tbot_s = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
        elif not outcome.error:
            outcome.error = "no tokens"
        return outcome, "".join(parts)


def engine_counters(engines: list[Any]) -> list[EngineCounters]:
    """Each engine's requests served and prefix-cache query and hit tokens (the fleet
    benchmark's scrape)."""
    pages = asyncio.run(scrape_engines({e.url: e.url for e in engines}, timeout_s=10.0))
    missing = [url for url, page in pages.items() if page is None]
    if missing:
        raise RuntimeError(f"no /metrics from {missing}")
    return [page for page in pages.values() if page is not None]


def warm(url: str, model: str, words: Words, requests: int = 3) -> None:
    """A few direct requests of unrelated text (the engine's first steps of a run are
    slower; every run starts on engines warmed the same way, before their caches are
    emptied)."""
    for _ in range(requests):
        body = {
            "model": model, "max_tokens": OUTPUT_TOKENS, "ignore_eos": True,
            "messages": [{"role": "user", "content": words.text(800)}],
        }  # fmt: skip
        req = urllib.request.Request(
            url + "/v1/chat/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()


def reset_prefix_cache(url: str, attempts: int = 20) -> None:
    """Empty the engine's prefix cache (fails while blocks are held: retried)."""
    for _ in range(attempts):
        req = urllib.request.Request(url + "/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            if json.loads(resp.read() or b"{}").get("success", True):
                return
        time.sleep(1.0)
    raise RuntimeError(f"{url}: the prefix cache could not be reset")


def summarize(
    outcomes: list[Outcome],
    before: list[EngineCounters],
    after: list[EngineCounters],
    args: Any,
) -> dict:
    """The run's figures (see the module docstring)."""
    good = [
        o for o in outcomes
        if not o.error and o.ttft_s <= args.ttft_slo_s
        and (o.tokens < 2 or o.tbot_s <= args.tbot_slo_s)
    ]  # fmt: skip
    ok = [o for o in outcomes if not o.error]
    delta = [a.minus(b) for a, b in zip(after, before, strict=True)]
    served = [d.requests for d in delta]
    queries = sum(d.prefix_queries_tokens for d in delta)
    hits = sum(d.prefix_hits_tokens for d in delta)
    return {
        "requests": len(outcomes),
        "errors": len(outcomes) - len(ok),
        "goodput": len(good) / len(outcomes) if outcomes else 0.0,
        "ttft_p50_s": percentile([o.ttft_s for o in ok], 0.5),
        "ttft_p99_s": percentile([o.ttft_s for o in ok], 0.99),
        "tbot_p99_s": percentile([o.tbot_s for o in ok if o.tokens > 1], 0.99),
        "engine_prefix_hit_rate": hits / queries if queries else None,
        "served_per_engine": served,
        "max_min_served": max(served) / min(served) if min(served) > 0 else None,
        "error_kinds": dict(Counter(o.error.split(":", 1)[0] for o in outcomes if o.error)),
    }


def policy_params(name: str) -> tuple[str, dict[str, int | float]]:
    """``"fastroute:prefix-hrw@stall_weight=0.3,balance_factor=3"`` → the router's name
    without the tunables and ``{tunable: value}`` (``[policy.params.<policy>]``)."""
    base, _, tunables = name.partition("@")
    params: dict[str, int | float] = {}
    for item in filter(None, tunables.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"router {name!r}: a tunable is KEY=VALUE, got {item!r}")
        params[key] = int(value) if value.lstrip("-").isdigit() else float(value)
    return base, params


def start_router(rh: ModuleType, name: str, engines: list[Any], run_dir: Path) -> Any:
    """``fastroute[:policy][@KEY=VALUE,...]`` (one worker, no controller; the tunables of
    the policy after ``@``) or a peer router by the fleet benchmark's names
    (``vllm-router:cache_aware``...), in front of ``engines``."""
    base, params = policy_params(name)
    plan = resolve_router(base, {})
    urls = [e.url for e in engines]
    if plan.kind == "fastroute":
        stack = rh.write_config(urls, run_dir, controller=False)
        with stack.config.open("a") as f:
            f.write(f'\n[policy]\ndefault = "{plan.policy}"\n')
            if params:
                f.write(f"[policy.params.{plan.policy}]\n")
                f.writelines(f"{k} = {v!r}\n" for k, v in params.items())
        return rh.start_proxy(stack, run_dir)
    if params:
        raise SystemExit(f"router {name!r}: tunables are for fastroute's policies")
    if plan.unavailable:
        raise SystemExit(f"router {name!r}: {plan.unavailable}")
    port = free_port()
    cmd = expand_command(
        plan.template, port=port, metrics_port=free_port(), worker_urls=urls, policy=plan.policy
    )
    log = run_dir / "router.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    return rh.Running(proc, f"http://127.0.0.1:{port}", log)


def wait_answers(rh: ModuleType, router: Any, timeout_s: float = 120.0) -> None:
    """Until a chat request through ``router`` answers 200 (every router's readiness)."""
    ready = {"model": rh.MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "ready"}]}
    try:
        asyncio.run(
            wait_http_ok(
                router.url + "/v1/chat/completions", timeout_s=timeout_s, interval_s=0.5,
                json_body=ready,
            )
        )  # fmt: skip
    except TimeoutError as exc:
        raise RuntimeError(f"{exc}\n{router.log.name}:\n{rh.tail(router.log)}") from None


def run_once(
    rh: ModuleType, engines: list[Any], name: str, conversations: list, args: Any, run_dir: Path
) -> dict:
    """One router over one workload: a fresh router, emptied caches, the replay."""
    run_dir.mkdir(parents=True, exist_ok=True)
    router = start_router(rh, name, engines, run_dir)
    try:
        wait_answers(rh, router)
        words = Words(random.Random(), args.tokens_per_word)
        with ThreadPoolExecutor(len(engines)) as pool:
            list(pool.map(lambda e: warm(e.url, rh.MODEL, words), engines))
        for e in engines:
            reset_prefix_cache(e.url)
        before = engine_counters(engines)
        cpu0 = session_cpu_s(router.proc.pid)
        client = Client(router.url, rh.MODEL)
        asyncio.run(client.run(conversations))
        cpu_s = session_cpu_s(router.proc.pid) - cpu0
        time.sleep(1.0)  # the engines' counters of the last requests
        after = engine_counters(engines)
    finally:
        rh.stop([router])
    result = summarize(client.outcomes, before, after, args)
    result["router_cpu_ms_per_request"] = 1e3 * cpu_s / max(1, result["requests"])
    (run_dir / "outcomes.json").write_text(json.dumps([asdict(o) for o in client.outcomes]))
    return result


# -- report ----------------------------------------------------------------------------------


def _fmt(v: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "—" if v is None else f"{v * scale:.{digits}f}"


def _row(workload: str, router: str, runs: list[dict[str, Any]]) -> str:
    def mean(key: str) -> float | None:
        vals = [r[key] for r in runs if r[key] is not None]
        return statistics.fmean(vals) if vals else None

    each = " / ".join(f"{r['goodput']:.3f}" for r in runs)
    cells = [
        workload,
        router,
        f"{mean('goodput'):.3f} ({each})",
        f"{_fmt(mean('ttft_p50_s'), 1e3)} / {_fmt(mean('ttft_p99_s'), 1e3)}",
        _fmt(mean("tbot_p99_s"), 1e3),
        f"{_fmt(mean('engine_prefix_hit_rate'), 100, 1)} %",
        _fmt(mean("max_min_served"), 1, 2),
        _fmt(mean("router_cpu_ms_per_request"), 1, 2),
    ]
    return "| " + " | ".join(cells) + " |"


def table(result: dict[str, Any]) -> str:
    """Markdown: one row per workload and router, each repeat's goodput and the means."""
    lines = [
        "| workload | router | goodput (each repeat) | TTFT p50 / p99 ms | TBOT p99 ms "
        "| engine prefix hit | max/min served | router CPU ms/req |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for workload, by_router in result["runs"].items():
        lines += [_row(workload, router, runs) for router, runs in by_router.items() if runs]
    return "\n".join(lines)


def tokens_per_word(url: str, model: str, words: Words) -> float:
    """The tokenizer's tokens per pseudo-word, from the engine's ``/tokenize``."""
    sample = words.text(2000)
    body = json.dumps({"model": model, "prompt": sample, "add_special_tokens": False}).encode()
    req = urllib.request.Request(url + "/tokenize", data=body,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as resp:
        count = json.loads(resp.read())["count"]
    return count / len(sample.split())


def workloads(args: Any, tokens_per_word_: float) -> dict[str, list[Conversation]]:
    """The seeded workloads the runs replay."""
    out: dict[str, list[Conversation]] = {}
    for name in args.workloads.split(","):
        words = Words(random.Random(f"{args.seed}-{name}"), tokens_per_word_)
        if name == "rag":
            out[name] = rag(words, args.rag_rate_rps, args.duration_s, args.documents)
        elif name == "sessions":
            out[name] = sessions(words, args.session_rate_per_s, args.duration_s)
        else:
            raise SystemExit(f"unknown workload {name!r}: rag, sessions")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "real-routers")
    parser.add_argument("--table", type=Path, help="print a results.json as Markdown, no run")
    parser.add_argument("--workloads", default="rag,sessions")
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration-s", type=float, default=50.0, help="arrivals, seconds")
    parser.add_argument("--rag-rate-rps", type=float, default=3.0)
    parser.add_argument("--session-rate-per-s", type=float, default=0.6)
    parser.add_argument("--documents", type=int, default=55)
    parser.add_argument("--kv-tokens", type=int, default=32768, help="KV cache per engine")
    parser.add_argument("--ttft-slo-s", type=float, default=1.0)
    parser.add_argument("--tbot-slo-s", type=float, default=0.1)
    parser.add_argument(
        "--warmup-router", default="fastroute:round-robin",
        help="one unmeasured replay of each workload through it first ('' for none)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rh = harness()
    inst = rh.installed()
    log_dir = Path(tempfile.mkdtemp(prefix="real-routers-"))
    engines = [
        rh.start_vllm(
            inst, log_dir, name=f"vllm-{i}", cpu=str(i), max_model_len=MAX_MODEL_LEN,
            kv_cache_bytes=args.kv_tokens * KV_BYTES_PER_TOKEN,
            extra_env={"VLLM_SERVER_DEV_MODE": "1"},  # POST /reset_prefix_cache
        )
        for i in range(2)
    ]  # fmt: skip
    routers = args.routers.split(",")
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": {}}
    try:
        print(f"vLLM ready in {rh.wait_ready(engines, '/health'):.0f} s", file=sys.stderr)
        tpw = tokens_per_word(engines[0].url, rh.MODEL, Words(random.Random(0)))
        result["tokens_per_word"] = args.tokens_per_word = tpw
        result["load_average_before"] = os.getloadavg()[0]
        for workload, conversations in workloads(args, tpw).items():
            by_router = result["runs"].setdefault(workload, {r: [] for r in routers})
            if args.warmup_router:
                warmup = run_once(
                    rh, engines, args.warmup_router, conversations, args,
                    log_dir / f"{workload}-warmup",
                )  # fmt: skip
                result.setdefault("warmup", {})[workload] = warmup
                print(workload, "warm-up (not measured)", json.dumps(warmup), file=sys.stderr)
            for repeat in range(args.repeats):
                order = routers[repeat % len(routers) :] + routers[: repeat % len(routers)]
                for router in order:
                    slug = "".join(c if c.isalnum() or c in "-_." else "-" for c in router)
                    run_dir = log_dir / f"{workload}-{slug}-{repeat}"
                    run = run_once(rh, engines, router, conversations, args, run_dir)
                    by_router[router].append(run)
                    print(workload, repeat, router, json.dumps(run), file=sys.stderr)
                    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    finally:
        rh.stop(engines)
    result["load_average_after"] = os.getloadavg()[0]
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
