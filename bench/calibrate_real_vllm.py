"""Measure one real vLLM's step times and fit fastroute.predict's step-time model to them.

    PYTHONPATH=. python bench/calibrate_real_vllm.py --out bench-results/calib [--engine URL]

Starts one CPU vLLM engine with the real tier's harness (``tests/real/real_harness.py``;
``--engine URL`` uses a running one, started the same way with ``max_model_len=2048``) and
measures, each point ``--repeats`` times:

* **prefill**: one request of ``n`` prompt tokens (random token ids, so every prompt is
  unique and the prefix cache never hits), ``max_tokens=1``; client-side latency and vLLM's
  own ``vllm:request_prefill_time_seconds`` (the engine's scheduled → first token);
* **decode**: ``B`` concurrent streams of ``p``-token prompts, ``ignore_eos`` and a fixed
  output length; client-side time per step over the window where all ``B`` decode, and
  vLLM's ``vllm:request_decode_time_seconds`` / (tokens − 1) and inter-token latency;
* **mixed**: a prefill of ``n`` tokens sent while ``B`` streams decode; the longest gap in
  the streams is the step that ran the chunk beside the decodes (validation only).

Each sequential request's own timings are the deltas of the histograms' ``_sum`` between
two scrapes of ``/metrics``, so they are exact, not bucketed. The machine is shared: noise
only ever adds time, so a point's value is the minimum over its repeats. The fit
(:func:`fastroute.predict.fit.fit_step_times`: relative NNLS) is done for the engine's
timings and for the client's; ``results.json`` in ``--out`` holds the points, both fits
and the per-point relative errors. Not a test: the numbers of docs/predict.md
("Fit on a real vLLM").
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from fastroute.hardware import get_profile
from fastroute.predict.fit import StepFit, fit_step_times
from fastroute.predict.step_time import (
    COEF_NAMES,
    NominalStepTimes,
    StepTimeModel,
    decode_features,
    prefill_features,
    step_features,
)

ROOT = Path(__file__).resolve().parent.parent
#: The timings of a point, each fitted on its own: vLLM's own histograms and the client's
#: clock.
TIMINGS = ("engine_s", "client_s")
#: The tiny model's positions; prompts up to 1500 tokens plus outputs fit.
MAX_MODEL_LEN = 2048
#: vLLM's per-step token budget for this engine (its default ``max_num_batched_tokens``).
BUDGET_TOKENS = 2048
#: Token ids drawn for prompts: above the special tokens, below the vocabulary size.
TOKEN_ID_RANGE = (100, 32000)
PREFILL_TOKENS = (16, 64, 128, 256, 384, 512, 768, 1024, 1280, 1500)
DECODE_BATCHES = (1, 2, 4, 8, 16)
#: Prompt length of the batch sweep and output length of every decode point.
DECODE_PROMPT_TOKENS = 16
DECODE_OUTPUT_TOKENS = 64
#: Context sweep: batch and prompt lengths (context per sequence ≈ prompt + outputs / 2).
CONTEXT_BATCH = 4
CONTEXT_PROMPT_TOKENS = (16, 256, 512, 1024, 1536)
#: Mixed steps: the decoding batch, the injected prefill lengths, and after how many tokens.
MIXED_BATCH = 4
MIXED_PREFILL_TOKENS = (256, 512, 1024)
MIXED_OUTPUT_TOKENS = 96
MIXED_INJECT_AFTER_TOKENS = 24
#: The online calibration's check: its starting constants and passes over the points.
ONLINE_START_PROFILE = "a40"
ONLINE_ROUNDS = 50
REQUEST_TIMEOUT_S = 300.0
#: Tries of a sample whose streams did not all decode at once (a loaded client). Each try
#: of a decode point costs ~1 s here; on the 2-core CI machine, while the test's own engine
#: and client share the cores, 3 tries were seen to fail together once in ~10 runs.
SAMPLE_ATTEMPTS = 6
#: Samples per point (the point keeps the minimum).
REPEATS = 7
PREFIX_HITS = "vllm:prefix_cache_hits_total"
# Histograms read per request (summed over label sets; one model, one engine).
_HISTOGRAMS = (
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:iteration_tokens_total",
)


def harness() -> ModuleType:
    """The real tier's harness module (``tests/real`` is not a package)."""
    sys.path.insert(0, str(ROOT / "tests" / "real"))
    return importlib.import_module("real_harness")


# -- the engine's own timings ------------------------------------------------------------


def scrape(url: str) -> dict[str, float]:
    """``_sum`` and ``_count`` of :data:`_HISTOGRAMS` and the prefix-cache hit counter
    from ``/metrics``."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        if name == PREFIX_HITS or any(name in (h + "_sum", h + "_count") for h in _HISTOGRAMS):
            out[name] = out.get(name, 0.0) + float(value)
    return out


def delta(after: dict[str, float], before: dict[str, float], hist: str) -> tuple[float, float]:
    """(Σ, count) of histogram ``hist`` between two scrapes."""
    return (
        after.get(hist + "_sum", 0.0) - before.get(hist + "_sum", 0.0),
        after.get(hist + "_count", 0.0) - before.get(hist + "_count", 0.0),
    )


# -- requests --------------------------------------------------------------------------------


def prompt_ids(rng: random.Random, n: int) -> list[int]:
    """``n`` random token ids: a prompt no earlier request shares a block with."""
    return [rng.randrange(*TOKEN_ID_RANGE) for _ in range(n)]


def _post(url: str, body: dict[str, Any]) -> urllib.request.Request:
    return urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )


def complete(url: str, model: str, prompt: list[int], max_tokens: int) -> float:
    """A non-streamed completion; its client-side latency (s)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    started = time.perf_counter()
    with urllib.request.urlopen(_post(url, body), timeout=REQUEST_TIMEOUT_S) as resp:
        reply = json.loads(resp.read())
    took = time.perf_counter() - started
    if reply["usage"]["completion_tokens"] != max_tokens:
        raise RuntimeError(f"asked for {max_tokens} tokens, got {reply['usage']}")
    return took


def stream_token_times(
    url: str, model: str, prompt: list[int], max_tokens: int, on_token: Callable[[int], None]
) -> list[float]:
    # on_token(count) runs as each token arrives.
    """Stream a completion; the arrival time of each output token (``perf_counter``)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    times: list[float] = []
    with urllib.request.urlopen(_post(url, body), timeout=REQUEST_TIMEOUT_S) as resp:
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            now = time.perf_counter()
            event = json.loads(line[6:])
            usage = event.get("usage") or {}
            while len(times) < usage.get("completion_tokens", 0):
                times.append(now)
                on_token(len(times))
    if len(times) != max_tokens:
        raise RuntimeError(f"asked for {max_tokens} tokens, streamed {len(times)}")
    return times


def concurrent_streams(
    probe: Probe, prompts: list[list[int]], max_tokens: int, inject: Callable[[], None]
) -> list[list[float]]:
    """Stream every prompt at once; ``inject()`` runs (once, in its own thread) when the
    first stream has :data:`MIXED_INJECT_AFTER_TOKENS` tokens. Token times per stream."""
    results: list[list[float]] = [[] for _ in prompts]
    errors: list[BaseException] = []
    fired = threading.Event()
    # Every thread sends at once: on a loaded machine, threads started one after another
    # reached the engine seconds apart, so the streams did not overlap.
    together = threading.Barrier(len(prompts))

    def on_token(count: int) -> None:
        if count == MIXED_INJECT_AFTER_TOKENS and not fired.is_set():
            fired.set()
            threading.Thread(target=inject, daemon=True).start()

    def run(i: int) -> None:
        try:
            together.wait(REQUEST_TIMEOUT_S)
            results[i] = stream_token_times(
                probe.url, probe.model, prompts[i], max_tokens, on_token
            )
        except BaseException as exc:  # surfaced below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S)
    if errors or any(t.is_alive() for t in threads):
        raise RuntimeError(f"a stream failed: {errors[:1]}")
    return results


class NoDecodeWindow(RuntimeError):
    """The streams did not all decode at once (one arrived after another had finished)."""


def steady_step_s(streams: list[list[float]]) -> float:
    """Mean step time over the window where every stream decodes (after the last first
    token, before the first last token): the window over the tokens in it, per stream.
    (Not a median of gaps: a client that lags reads two tokens in one event, gap 0.)

    A stream whose tokens all arrived at one instant was read late by its client thread
    (the engine decoded it with the others; vLLM's output collector merged its unread
    deltas): its times say nothing about the window, so it is left out, as long as one
    stream with a real span remains.
    """
    spanned = [s for s in streams if s[-1] > s[0]]
    if not spanned:
        raise NoDecodeWindow("every stream arrived in one read")
    start = max(s[0] for s in spanned)
    end = min(s[-1] for s in spanned)
    steps = [sum(1 for t in s if start < t <= end) for s in spanned]
    if end <= start or min(steps) < 2:
        raise NoDecodeWindow("no window where every stream decodes")
    return (end - start) / statistics.mean(steps)


# -- the points ------------------------------------------------------------------------------


class Probe:
    """The engine under measurement, its step token budget and a random prompt source;
    each method takes one sample of a point (a dict of timings, seconds)."""

    def __init__(
        self, url: str, model: str, budget: int = BUDGET_TOKENS, seed: int | None = None
    ) -> None:
        self.url, self.model, self.budget = url, model, budget
        # Unseeded by default: a second run against the same engine must not replay the
        # first run's prompts (they would hit its prefix cache).
        self.rng = random.Random(seed)

    def prefill(self, n: int) -> dict[str, float]:
        """One request of ``n`` prompt tokens, ``max_tokens=1``."""
        before = scrape(self.url)
        client = complete(self.url, self.model, prompt_ids(self.rng, n), 1)
        after = scrape(self.url)
        hits = after[PREFIX_HITS] - before[PREFIX_HITS]
        if hits:
            raise RuntimeError(f"a unique prompt hit the prefix cache ({hits:g} tokens)")
        return {
            "client_s": client,
            "engine_s": delta(after, before, "vllm:request_prefill_time_seconds")[0],
            "engine_ttft_s": delta(after, before, "vllm:time_to_first_token_seconds")[0],
        }

    def decode(self, batch: int, prompt: int, output: int) -> dict[str, float]:
        """``batch`` concurrent streams of ``prompt`` + ``output`` tokens."""
        prompts = [prompt_ids(self.rng, prompt) for _ in range(batch)]
        before = scrape(self.url)
        streams = concurrent_streams(self, prompts, output, lambda: None)
        after = scrape(self.url)
        dec_sum, dec_count = delta(after, before, "vllm:request_decode_time_seconds")
        sample = {"client_s": steady_step_s(streams)}
        if batch * prompt <= self.budget:
            # Otherwise the prompts were prefilled over several steps, beside the first
            # ones' decodes, and the engine's decode time includes those mixed steps (the
            # client's window does not).
            sample["engine_s"] = dec_sum / dec_count / (output - 1)
        return sample

    def mixed(self, batch: int, n: int) -> dict[str, float]:
        """Longest inter-token gap of ``batch`` decoding streams while an ``n``-token
        prefill runs beside them, and the context then."""
        prompts = [prompt_ids(self.rng, DECODE_PROMPT_TOKENS) for _ in range(batch)]
        extra = prompt_ids(self.rng, n)
        streams = concurrent_streams(
            self, prompts, MIXED_OUTPUT_TOKENS, lambda: complete(self.url, self.model, extra, 1)
        )
        # The same step stalls every stream: its gap is the median stream's longest.
        longest = [max(range(1, len(s)), key=lambda k, s=s: s[k] - s[k - 1]) for s in streams]
        gap = statistics.median(s[k] - s[k - 1] for s, k in zip(streams, longest, strict=True))
        return {"client_s": gap, "context": batch * DECODE_PROMPT_TOKENS + sum(longest)}


def sweep(quick: bool, budget: int = BUDGET_TOKENS) -> list[dict[str, Any]]:
    """The points to measure (``quick``: a few of each kind, for the real-tier test). A
    mixed point needs its prefill in one step beside the batch (its features assume it)."""
    pf = (16, 256, 768) if quick else PREFILL_TOKENS
    batches = (1, 4, 8) if quick else DECODE_BATCHES
    output = DECODE_OUTPUT_TOKENS
    points: list[dict[str, Any]] = [{"kind": "prefill", "n": n} for n in pf]
    points += [
        {"kind": "decode", "batch": b, "prompt": DECODE_PROMPT_TOKENS, "output": output}
        for b in batches
    ]
    if not quick:
        points += [
            {"kind": "decode", "batch": CONTEXT_BATCH, "prompt": p, "output": output}
            for p in CONTEXT_PROMPT_TOKENS[1:]
        ]
        points += [
            {"kind": "mixed", "batch": MIXED_BATCH, "n": n}
            for n in MIXED_PREFILL_TOKENS
            if n + MIXED_BATCH <= budget
        ]
    for p in points:
        if p["kind"] == "decode":
            # Mean context of the decoding steps: prompts plus half the outputs.
            p["context"] = p["batch"] * (p["prompt"] + p["output"] // 2)
    return points


def sample(probe: Probe, point: dict[str, Any]) -> dict[str, float]:
    """One sample of ``point`` (streams that did not overlap are tried again)."""
    args = {k: v for k, v in point.items() if k not in ("kind", "context", "budget")}
    for _ in range(SAMPLE_ATTEMPTS - 1):
        try:
            return getattr(probe, point["kind"])(**args)
        except NoDecodeWindow:
            continue
    return getattr(probe, point["kind"])(**args)


def measure(probe: Probe, repeats: int, *, quick: bool = False, seed: int = 0) -> list[dict]:
    """Every point ``repeats`` times, the repeats interleaved in a shuffled order (so a
    burst of load on the shared machine hits different points, not all repeats of one);
    a point's timing is the minimum over its repeats (noise only adds time)."""
    points = sweep(quick, probe.budget)
    for p in points:
        p["budget"] = probe.budget  # the chunk size the prefill features assume
    probe.prefill(64)  # warm-up: the first requests of a fresh engine are slow
    concurrent_streams(probe, [prompt_ids(probe.rng, DECODE_PROMPT_TOKENS)] * 2, 16, lambda: None)
    samples: list[list[dict[str, float]]] = [[] for _ in points]
    order = random.Random(seed)
    for rep in range(repeats):
        for i in order.sample(range(len(points)), len(points)):
            samples[i].append(sample(probe, points[i]))
        print(f"repeat {rep + 1}/{repeats} done", file=sys.stderr, flush=True)
    for point, got in zip(points, samples, strict=True):
        for key in got[0]:
            values = [s[key] for s in got]
            best = min(range(len(values)), key=values.__getitem__)
            if key == "context":
                continue
            point[key] = values[best]
            point[key.replace("_s", "_all_s")] = values
            if point["kind"] == "mixed" and key == "client_s":
                point["context"] = got[best]["context"]
    return points


# -- the fit ---------------------------------------------------------------------------------


def point_features(point: dict[str, Any]) -> list[float]:
    """The step-time model's summed features of a measured point."""
    if point["kind"] == "prefill":
        return prefill_features(point["n"], budget=point.get("budget", BUDGET_TOKENS))
    if point["kind"] == "decode":
        return decode_features(point["batch"], point["context"])
    n = point["n"]
    return step_features(point["batch"], point["context"], n, float(n * n))


def fit(points: list[dict[str, Any]], timing: str) -> StepFit:
    """Fit on the prefill and decode points' ``timing`` (``client_s`` or ``engine_s``)."""
    used = [p for p in points if p["kind"] != "mixed" and timing in p]
    return fit_step_times([point_features(p) for p in used], [p[timing] for p in used])


def online_fit(points: list[dict[str, Any]], timing: str, seed: int = 0) -> dict[str, Any]:
    """The proxy's online calibration (:class:`~fastroute.predict.StepTimeModel`, RLS)
    started from the emulator's a40 constants and fed the prefill and decode points
    :data:`ONLINE_ROUNDS` times in shuffled order: its coefficients and relative errors."""
    nominal = NominalStepTimes.from_profile(
        get_profile(ONLINE_START_PROFILE), max_num_batched_tokens=BUDGET_TOKENS
    )
    model = StepTimeModel(nominal)
    used = [p for p in points if p["kind"] != "mixed" and timing in p]
    order = random.Random(seed)
    for _ in range(ONLINE_ROUNDS):
        for p in order.sample(used, len(used)):
            model.observe(point_features(p), p[timing], kind=p["kind"])
    err = [model.rls.predict_list(point_features(p)) / p[timing] - 1.0 for p in used]
    abs_err = sorted(abs(e) for e in err)
    return {
        "coef": dict(zip(COEF_NAMES, model.rls.coef, strict=True)),
        "rel_err": err,
        "p50_abs_rel_err": statistics.median(abs_err),
        "p90_abs_rel_err": abs_err[min(len(abs_err) - 1, round(0.9 * (len(abs_err) - 1)))],
    }


def report(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Per timing: the fit, its per-point errors and its errors on the held-out mixed steps."""
    out: dict[str, Any] = {}
    for timing in TIMINGS:
        if not any(timing in p for p in points):
            continue
        result = fit(points, timing)
        mixed = [p for p in points if p["kind"] == "mixed" and timing in p]
        out[timing] = {
            "coef": result.coef,
            "p50_abs_rel_err": result.p50_abs_rel_err,
            "p90_abs_rel_err": result.p90_abs_rel_err,
            "max_abs_rel_err": result.max_abs_rel_err,
            "rel_err": result.rel_err,
            "mixed_rel_err": [result.predict(point_features(p)) / p[timing] - 1.0 for p in mixed],
            "online": online_fit(points, timing),
        }
    return out


def table(result: dict[str, Any]) -> str:
    """The points, both fits' predictions and relative errors as a Markdown table."""
    fits = {t: fit(result["points"], t) for t in TIMINGS if any(t in p for p in result["points"])}
    head = "".join(f" {t.removesuffix('_s')} (ms) | fit (ms) | err |" for t in fits)
    lines = ["| point |" + head, "|---|" + "---|---|---|" * len(fits)]
    for p in result["points"]:
        if p["kind"] == "prefill":
            name = f"prefill n={p['n']}"
        elif p["kind"] == "decode":
            name = f"decode B={p['batch']} S={p['context']}"
        else:
            name = f"mixed B={p['batch']} S={p['context']} + n={p['n']}"
        cells = [name]
        for timing, result_fit in fits.items():
            if timing not in p:
                cells += ["–", "–", "–"]
                continue
            pred = result_fit.predict(point_features(p))
            err = pred / p[timing] - 1.0
            mark = "" if p["kind"] != "mixed" else " (held out)"
            cells += [f"{1e3 * p[timing]:.1f}", f"{1e3 * pred:.1f}", f"{100 * err:+.0f} %{mark}"]
        lines.append("| " + " | ".join(cells) + " |")
    for timing, result_fit in fits.items():
        coef = ", ".join(f"{n} = {c:.3g}" for n, c in result_fit.coef.items() if c)
        p50, p90 = result_fit.p50_abs_rel_err, result_fit.p90_abs_rel_err
        worst = result_fit.max_abs_rel_err
        lines.append(
            f"\n{timing}: {coef}; |err| p50 {100 * p50:.1f} %, p90 {100 * p90:.1f} %, "
            f"max {100 * worst:.1f} %"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "calib")
    parser.add_argument("--engine", help="a running engine's URL (default: start one)")
    parser.add_argument("--cpu", default="0", help="core(s) the started engine is pinned to")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument(
        "--budget", type=int, help="--max-num-batched-tokens of the started engine (chunk size)"
    )
    parser.add_argument("--quick", action="store_true", help="a few points of each kind")
    parser.add_argument("--table", type=Path, help="print a results.json as Markdown, no run")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    budget = args.budget or BUDGET_TOKENS
    rh = harness()
    runs = []
    if args.engine:
        url = args.engine
    else:
        log_dir = Path(tempfile.mkdtemp(prefix="calib-vllm-"))
        runs = [
            rh.start_vllm(
                rh.installed(),
                log_dir,
                name="vllm",
                cpu=args.cpu,
                max_model_len=MAX_MODEL_LEN,
                extra_args=("--max-num-batched-tokens", str(budget)) if args.budget else (),
            )  # fmt: skip
        ]
        print(f"vLLM ready in {rh.wait_ready(runs, '/health'):.0f} s", file=sys.stderr)
        url = runs[0].url
    load_before = os.getloadavg()
    try:
        points = measure(Probe(url, rh.MODEL, budget), args.repeats, quick=args.quick)
    finally:
        rh.stop(runs)
    result = {
        "engine": {"cpu": args.cpu, "max_model_len": MAX_MODEL_LEN, "budget": budget},
        "repeats": args.repeats,
        "load_average_before_after": [load_before[0], os.getloadavg()[0]],
        "points": points,
        "fit": report(points),
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
