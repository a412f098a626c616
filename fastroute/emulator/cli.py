"""``fastroute engine``: run N emulated engines (vLLM by default) in one process, one port each.

Heavy imports (aiohttp, uvloop) happen in :func:`run`, so ``fastroute --help``
stays fast.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys

from fastroute.emulator.bootstrap import DEFAULT_BOOTSTRAP_TIMEOUT_S

__all__ = ["add_arguments", "run", "serve_fleet", "parse_step_time_factors"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``engine`` subcommand's options to ``parser``."""
    from fastroute.hardware import PROFILES

    parser.add_argument("--count", type=int, default=1, help="engines to run (default 1)")
    parser.add_argument(
        "--base-port", type=int, default=8100,
        help="port of the first engine; engine i listens on base+i (0: ephemeral ports)",
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default loopback)")
    parser.add_argument("--profile", default="a40", choices=sorted(PROFILES))
    parser.add_argument(
        "--step-time-factor", action="append", default=[], metavar="COEF=FACTOR",
        help="run true step times: scale the profile's coefficient COEF (a0_s, a1_s, a2_s, "
        "a3_s, b0_s, b1_s, b2_s) by FACTOR > 0; repeatable. The profile name is kept, so "
        "routers configured with it start from the datasheet constants",
    )  # fmt: skip
    parser.add_argument(
        "--model", default="meta-llama/Meta-Llama-3-8B-Instruct", help="served model name"
    )
    parser.add_argument("--role", default="both", choices=["both", "prefill", "decode"])
    parser.add_argument("--region", default="", help="region label (fastroute_emulator_info)")
    parser.add_argument("--seed", type=int, default=0, help="engine i uses seed+i")
    parser.add_argument("--name-prefix", default="engine", help="engines are named PREFIX-i")
    parser.add_argument(
        "--metrics-compat", default="current", choices=["current", "legacy", "both"],
        help="vLLM metric names: current (kv_cache_usage_perc), legacy (gpu_cache_usage_perc)",
    )  # fmt: skip
    parser.add_argument("--load-time-s", type=float, default=0.0, help="/health is 503 this long")
    real = parser.add_argument_group("behave like a real engine")
    real.add_argument(
        "--kind", default="vllm", choices=["vllm", "sglang", "llamacpp"],
        help="engine to behave like: /metrics dialect, error shape, reasoning delta field",
    )  # fmt: skip
    real.add_argument(
        "--bootstrap-port", type=int, default=0,
        help="--kind sglang --role prefill: engine i's P/D bootstrap port is PORT+i "
        "(SGLang's --disaggregation-bootstrap-port; 0: ephemeral, logged)",
    )  # fmt: skip
    real.add_argument(
        "--bootstrap-timeout-s", type=float, default=DEFAULT_BOOTSTRAP_TIMEOUT_S,
        help="--kind sglang --role decode: how long a request waits for the prefill of its "
        "bootstrap_room before failing (500)",
    )  # fmt: skip
    real.add_argument(
        "--stream-interval", type=int, default=1,
        help="tokens per SSE event (vLLM --stream-interval; a request's stream_interval wins)",
    )  # fmt: skip
    real.add_argument(
        "--final-empty-delta", action="store_true",
        help="a stop ends on an empty-text end-of-sequence token, as real engines' do",
    )  # fmt: skip
    real.add_argument(
        "--no-prompt-tokens-details", action="store_true",
        help="usage.prompt_tokens_details is null (vLLM without --enable-prompt-tokens-details)",
    )  # fmt: skip
    real.add_argument(
        "--reasoning-tokens", type=int, default=0,
        help="the first N output tokens of a chat answer are reasoning deltas",
    )  # fmt: skip
    real.add_argument(
        "--otlp-traces-endpoint", default="",
        help="OTLP/HTTP traces URL: one llm_request span per request, a child of its "
        "traceparent (vLLM's --otlp-traces-endpoint; needs fastroute[tracing])",
    )  # fmt: skip
    sched = parser.add_argument_group("scheduler")
    sched.add_argument("--max-num-seqs", type=int, default=256)
    sched.add_argument("--max-num-batched-tokens", type=int, default=None)
    sched.add_argument("--max-model-len", type=int, default=None)
    sched.add_argument("--num-blocks", type=int, default=None, help="override KV capacity")
    sched.add_argument("--max-waiting", type=int, default=1024, help="then 429")
    sched.add_argument("--no-prefix-caching", action="store_true")
    sched.add_argument("--kv-transfer-timeout-s", type=float, default=480.0)
    faults = parser.add_argument_group("faults (also live: POST /admin/fault)")
    faults.add_argument("--slowdown", type=float, default=1.0, help="step-time multiplier")
    faults.add_argument("--error-rate", type=float, default=0.0)
    faults.add_argument("--error-status", type=int, default=500, choices=[429, 500, 503])
    faults.add_argument("--hang", action="store_true", help="accept requests, never answer")
    faults.add_argument("--crash-after-tokens", type=int, default=None)
    faults.add_argument(
        "--stream-error-after-tokens", type=int, default=None,
        help="break streams off with an in-stream error event after N tokens",
    )  # fmt: skip
    faults.add_argument("--metrics-delay-s", type=float, default=0.0)
    faults.add_argument(
        "--metrics-lie", action="store_true", help="/metrics claims an idle engine while it serves"
    )
    faults.add_argument("--drain", action="store_true")
    faults.add_argument(
        "--refuse-for-s", type=float, default=None,
        help="start with the listener closed for this long",
    )  # fmt: skip


def parse_step_time_factors(items: list[str], profile: str) -> dict[str, float]:
    """``["b0_s=1.5", ...]`` → ``{"b0_s": 1.5}``, checked against ``profile``.

    Raises
    ------
    ValueError
        Not ``COEF=FACTOR``, a repeated or unknown coefficient, or a factor that is
        not a number > 0 (the message names the item).
    """
    from fastroute.emulator.profiles import true_profile
    from fastroute.hardware import get_profile

    factors: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        try:
            if not sep or not key:
                raise ValueError("expected COEF=FACTOR")
            if key in factors:
                raise ValueError(f"{key} given twice")
            factors[key] = float(value)
        except ValueError as exc:
            raise ValueError(f"--step-time-factor {item!r}: {exc}") from None
    try:
        true_profile(get_profile(profile), factors)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"--step-time-factor: {exc}") from None
    return factors


def _specs(args: argparse.Namespace) -> list:
    from fastroute.emulator.faults import FaultState
    from fastroute.emulator.model import EngineConfig
    from fastroute.emulator.server import fleet_specs

    config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_blocks=args.num_blocks,
        max_waiting=args.max_waiting,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_transfer_timeout_s=args.kv_transfer_timeout_s,
    )
    faults = FaultState(
        slowdown=args.slowdown,
        error_rate=args.error_rate,
        error_status=args.error_status,
        hang=args.hang,
        crash_after_tokens=args.crash_after_tokens,
        stream_error_after_tokens=args.stream_error_after_tokens,
        refuse_connections=args.refuse_for_s is not None,
        refuse_for_s=args.refuse_for_s,
        metrics_delay_s=args.metrics_delay_s,
        metrics_lie=args.metrics_lie,
        drain=args.drain,
    )
    faults.validate()
    if args.stream_interval < 1 or args.reasoning_tokens < 0:
        raise ValueError("--stream-interval must be >= 1 and --reasoning-tokens >= 0")
    if args.bootstrap_port < 0 or args.bootstrap_timeout_s <= 0:
        raise ValueError("--bootstrap-port must be >= 0 and --bootstrap-timeout-s > 0")
    specs = fleet_specs(
        args.count,
        base_port=args.base_port,
        name_prefix=args.name_prefix,
        seed=args.seed,
        model_name=args.model,
        profile=args.profile,
        step_time_factors=parse_step_time_factors(args.step_time_factor, args.profile),
        role=args.role,
        region=args.region,
        host=args.host,
        config=config,
        faults=faults,
        metrics_compat=args.metrics_compat,
        load_time_s=args.load_time_s,
        kind=args.kind,
        stream_interval=args.stream_interval,
        final_empty_delta=args.final_empty_delta,
        prompt_tokens_details=not args.no_prompt_tokens_details,
        reasoning_tokens=args.reasoning_tokens,
        bootstrap_timeout_s=args.bootstrap_timeout_s,
    )
    if args.otlp_traces_endpoint:
        from fastroute.emulator.tracing import otlp_tracer_provider

        provider = otlp_tracer_provider(args.otlp_traces_endpoint, "fastroute-engine")
        specs = [dataclasses.replace(spec, tracer_provider=provider) for spec in specs]
    if args.bootstrap_port:
        specs = [
            dataclasses.replace(spec, bootstrap_port=args.bootstrap_port + i)
            for i, spec in enumerate(specs)
        ]
    return specs


async def serve_fleet(specs: list) -> None:
    """Serve the engines of ``specs`` until SIGINT or SIGTERM.

    Prints ``engine NAME listening on URL`` per engine once all listen: the readiness line
    ``fastroute engine``'s parents read (the benchmark's engine runner prints it too).
    """
    from fastroute.emulator.server import EmulatedFleet

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    fleet = EmulatedFleet(specs)
    await fleet.start()
    try:
        for engine in fleet.engines:
            print(f"engine {engine.name} listening on {engine.url}", flush=True)
        await stop.wait()
    finally:
        await fleet.stop()


def run(args: argparse.Namespace) -> int:
    """Run the engines until SIGINT/SIGTERM; return the exit status."""
    if args.count < 1:
        print("fastroute engine: --count must be >= 1", file=sys.stderr)
        return 2
    try:
        specs = _specs(args)
    except ValueError as exc:
        print(f"fastroute engine: {exc}", file=sys.stderr)
        return 2
    import uvloop

    try:
        uvloop.run(serve_fleet(specs))
    except OSError as exc:  # e.g. port in use
        print(f"fastroute engine: {exc}", file=sys.stderr)
        return 1
    return 0
