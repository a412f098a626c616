"""How long a drain waits for its streams, with and without the drain hand-off (a script,
not a pytest file).

Set-up, all on 127.0.0.1, in this process: two emulated engines and a proxy started from a
config file (so the fleet admin API works), ``retry.drain_handoff_after_s`` set per run.
Each run sends ``--streams`` streamed chats of ``--tokens`` tokens, all ranked first on
engine A, which is slowed down ``--slowdown`` times (a busy engine); once the first stream
has ``--drain-after`` tokens, A is drained through the admin API. Measured: the drain's
wait (the admin API's reply to the moment A has nothing running), the tokens A and the
other engine made, and whether every client got exactly the whole-served text.

Run: ``.venv/bin/python bench/bench_drain_handoff.py`` (about a minute); ``--json PATH``
also writes the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from fastroute.config import decode_config
from fastroute.emulator.server import EmulatedFleet, fleet_specs
from fastroute.hashing import key_hash
from fastroute.proxy.proxy_app import ProxyApp
from fastroute.testing.configs import engines_toml
from fastroute.testing.servers import serve_proxy_app

MODEL = "demo-8b"


def _body(tokens: int, n: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "stream": True,
        "max_tokens": tokens,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": f"tell me story {n}"}],
    }


async def _stream(s: aiohttp.ClientSession, url: str, body: dict[str, Any], sid: str,
                  on_words: Any = None) -> str:  # fmt: skip
    text: list[str] = []
    async with s.post(url, json=body, headers={"x-session-id": sid}) as resp:
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            for choice in json.loads(line[6:]).get("choices") or ():
                text.append(choice.get("delta", {}).get("content") or "")
            if on_words is not None:
                await on_words(len("".join(text).split()))
    return "".join(text)


async def _run(args: argparse.Namespace, after_s: float, tmp: Path) -> dict[str, Any]:
    specs = fleet_specs(2, model_name=MODEL, profile="h100")
    async with EmulatedFleet(specs) as fleet:
        path = tmp / f"run-{after_s}.toml"
        extra = f"\n[retry]\ndrain_handoff_after_s = {after_s}\n"
        path.write_text(
            engines_toml(fleet.urls, MODEL) + extra + "\n[proxy]\nport = 0\n"
            'table_name = "fastroute-bench-drain-absent"\n'
        )
        app = ProxyApp(decode_config(path.read_text(), source=str(path)), config_path=path)
        async with serve_proxy_app(app) as (url, _), aiohttp.ClientSession() as s:
            fleet_view = app.context.fleet
            row = fleet_view.rows[(MODEL, "default")]
            sids = [f"s{i}" for i in range(200)]
            first = [int(fleet_view.state.selector.rank(key_hash(x), row, 1)[0]) for x in sids]
            a = first[0]
            on_a = [x for x, f in zip(sids, first, strict=True) if f == a][: args.streams]
            chat = url + "/v1/chat/completions"
            bodies = [_body(args.tokens, n) for n in range(len(on_a))]
            refs = await asyncio.gather(
                *(_stream(s, chat, b, x) for b, x in zip(bodies, on_a, strict=True))
            )
            engine_a, other = fleet[a], fleet[1 - a]
            await engine_a.set_faults(slowdown=args.slowdown)
            made_before = [e.model.num_steps_total for e in (engine_a, other)]
            drained = asyncio.Event()
            times: dict[str, float] = {}

            async def maybe_drain(words: int) -> None:
                if words >= args.drain_after and not drained.is_set():
                    drained.set()
                    async with s.post(f"{url}/admin/engines/engine-{a}/drain") as r:
                        assert r.status == 200, await r.text()
                    times["drained"] = time.monotonic()
                    while engine_a.model.num_running:
                        await asyncio.sleep(0.005)
                    times["idle"] = time.monotonic()

            async def watched(n: int) -> str:
                return await _stream(s, chat, bodies[n], on_a[n], maybe_drain if n == 0 else None)

            started = time.monotonic()
            got = await asyncio.gather(*(watched(n) for n in range(len(on_a))))
            ended = time.monotonic()
            steps = [
                e.model.num_steps_total - b
                for e, b in zip((engine_a, other), made_before, strict=True)
            ]
            return {
                "drain_handoff_after_s": after_s,
                "drain_wait_s": round(times["idle"] - times["drained"], 2),
                "streams_s": round(ended - started, 2),
                "exact": sum(g == r for g, r in zip(got, refs, strict=True)),
                "streams": len(on_a),
                "steps_drained_engine": steps[0],
                "steps_other_engine": steps[1],
            }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--slowdown", type=float, default=4.0)
    parser.add_argument("--drain-after", type=int, default=20)
    parser.add_argument("--delays", default="-1,5,0", help="drain_handoff_after_s values")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for after_s in (float(x) for x in args.delays.split(",")):
            rows.append(asyncio.run(_run(args, after_s, Path(tmp))))
            print(json.dumps(rows[-1]), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
