"""``/v1/responses`` through the proxy, with the official ``openai`` client.

Emulated engines store every response they answer; a follow-up naming it
(``previous_response_id``) must reach that engine, whichever proxy worker serves it: the
last test runs a real ``fastroute serve`` with two workers, a fresh connection per
turn, and checks every turn of a conversation against the engine that stored the
previous one (``x-fastroute-engine``) while the turns are served by both workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from proxy_harness import MODEL, SHORT_OUTPUTS, Harness, config_toml, decision_record

from fastroute.emulator.server import EmulatedFleet, fleet_specs
from fastroute.proxy.path.api_endpoints import PIN_REASON

pytestmark = pytest.mark.integration

START_TIMEOUT_S = 20.0
#: Most turns of the two-worker conversation (it ends once both workers served turns).
MAX_TURNS = 16
MIN_TURNS = 3


def _engine_text(fleet: EmulatedFleet, response_id: str) -> str:
    """The text the engine that stored ``response_id`` answered (its own record)."""
    for engine in fleet:
        stored = engine.responses_api.stored.get(response_id)
        if stored is not None:
            return str(stored.response["output"][0]["content"][0]["text"])
    raise AssertionError(f"no engine stored {response_id}")


def test_responses_create_stream_and_not_then_retrieve(h: Harness) -> None:
    """Not streamed and streamed answers parse with the official client; the streamed text
    is the engine's, its usage the engine's; the proxy measured the stream token-true;
    ``responses.retrieve`` returns the stored response from its engine."""

    async def main() -> None:
        async with h.proxy_stack(2) as st, aiohttp.ClientSession() as s:
            client = st.client()

            def calls() -> tuple[Any, list[Any], Any, str]:
                first = client.responses.create(
                    model=MODEL, instructions="Be terse.", input="Hello", max_output_tokens=6
                )
                raw = client.responses.with_raw_response.create(
                    model=MODEL, input=[{"role": "user", "content": "Tell me"}], stream=True
                )
                events = list(raw.parse())
                got = client.responses.retrieve(first.id)
                return first, events, got, raw.headers["x-request-id"]

            first, events, got, rid = await asyncio.to_thread(calls)
            assert first.status in ("completed", "incomplete")
            assert first.output_text == _engine_text(st.fleet, first.id)
            assert first.usage is not None and 1 <= first.usage.output_tokens <= 6
            types = [e.type for e in events]
            assert types[:2] == ["response.created", "response.in_progress"]
            assert types[-1] == "response.completed"
            done = events[-1].response
            deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
            assert "".join(deltas) == done.output_text == _engine_text(st.fleet, done.id)
            assert got.id == first.id and got.output_text == first.output_text
            record = await decision_record(s, st.url, rid)
            (attempt,) = record["attempts"]
            assert attempt["output_tokens"] == done.usage.output_tokens
            assert record["timings"]["first_token"] > 0

    h.run(main())


def test_previous_response_id_follows_the_storing_engine(h: Harness) -> None:
    """Each turn names the previous response: it is pinned to the engine that stored it
    (decision reason ``response-affinity``) and the engine sees the whole conversation
    (its prompt grows and hits its prefix cache); an unknown id is the engine's 404."""

    async def main() -> None:
        async with h.proxy_stack(3) as st, aiohttp.ClientSession() as s:
            client = st.client()

            def turns() -> list[tuple[Any, str, str]]:
                out = []
                previous = None
                for i in range(3):
                    raw = client.responses.with_raw_response.create(
                        model=MODEL,
                        input=f"{uuid.uuid4().hex}: turn {i}",
                        previous_response_id=previous,
                        max_output_tokens=4,
                    )
                    resp = raw.parse()
                    out.append(
                        (resp, raw.headers["x-fastroute-engine"], raw.headers["x-request-id"])
                    )
                    previous = resp.id
                return out

            results = await asyncio.to_thread(turns)
            engines = {engine for _, engine, _ in results}
            assert len(engines) == 1, results
            prompts = [r.usage.input_tokens for r, _, _ in results]
            assert prompts == sorted(prompts) and prompts[0] < prompts[-1]
            assert results[-1][0].usage.input_tokens_details.cached_tokens > 0
            for _, _, rid in results[1:]:
                assert (await decision_record(s, st.url, rid))["reason"] == PIN_REASON
            with pytest.raises(openai.NotFoundError) as err:
                await asyncio.to_thread(
                    client.responses.create,
                    model=MODEL,
                    input="x",
                    previous_response_id="resp_unknown0",
                )
            assert err.value.body["message"] == "Response with id 'resp_unknown0' not found."
            with pytest.raises(openai.NotFoundError):
                await asyncio.to_thread(client.responses.retrieve, "resp_unknown1")

    h.run(main())


def test_stored_response_routes_not_served_are_404(h: Harness) -> None:
    """``DELETE /v1/responses/{id}`` (vLLM has none) and unknown actions are OpenAI 404s;
    cancel of a finished response is the engine's own 400, relayed."""

    async def main() -> None:
        async with h.proxy_stack(1) as st, aiohttp.ClientSession() as s:
            body = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
            async with s.post(st.url + "/v1/responses", json=body) as r:
                assert r.status == 200
                response_id = (await r.json())["id"]
            async with s.delete(st.url + f"/v1/responses/{response_id}") as r:
                assert r.status == 404
                assert "DELETE" in (await r.json())["error"]["message"]
            async with s.post(st.url + f"/v1/responses/{response_id}/nope") as r:
                assert r.status == 404
            async with s.post(st.url + f"/v1/responses/{response_id}/cancel") as r:
                assert r.status == 400
                assert r.headers["x-fastroute-engine"] == "engine-0"
                assert "Cannot cancel" in (await r.json())["error"]["message"]

    h.run(main())


# -- two workers ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def serve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Start a ``fastroute serve`` tree (private shm dir); kill its group at teardown."""
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("FASTROUTE_SHM_DIR", str(shm))
    procs: list[subprocess.Popen[bytes]] = []

    def start(config_text: str, workers: int) -> tuple[str, Path]:
        port = _free_port()
        stats = f"fastroute-test-stats-{uuid.uuid4().hex[:12]}"
        config = tmp_path / "fastroute.toml"
        config.write_text(config_text.replace("[proxy]\n", f'[proxy]\nstats_name = "{stats}"\n'))
        log = tmp_path / "serve.log"
        with log.open("wb") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "fastroute", "serve", "--config", str(config)]
                    + ["--port", str(port), "--workers", str(workers)],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                    start_new_session=True,
                )
            )
        return f"http://127.0.0.1:{port}", log

    try:
        yield start
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


def _turn(url: str, text: str, previous: str | None) -> tuple[str, str, str, str]:
    """One turn on a fresh connection (a new client): (response id, engine, worker,
    decision header)."""
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=15.0) as client:
        raw = client.responses.with_raw_response.create(
            model=MODEL, input=text, previous_response_id=previous, max_output_tokens=3
        )
        headers = raw.headers
        return (
            raw.parse().id,
            headers["x-fastroute-engine"],
            headers["x-fastroute-worker"],
            headers["x-fastroute-decision"],
        )


def test_previous_response_id_across_two_workers(h: Harness, serve: Any) -> None:
    """A real ``fastroute serve`` with ``proxy.workers = 2`` over two engines: every turn
    reaches the engine that stored the previous response, also when the worker serving
    it is not the one that relayed that response (the id map is the host's)."""

    async def main() -> None:
        specs = fleet_specs(2, model_name=MODEL, profile="h100", output_lengths=SHORT_OUTPUTS)
        async with EmulatedFleet(specs) as fleet:
            url, log = serve(config_toml(fleet.urls), workers=2)

            async def ready() -> bool:
                try:
                    async with aiohttp.ClientSession() as s, s.get(url + "/ready") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False

            await h.wait_until(ready, timeout=START_TIMEOUT_S, interval=0.05)
            turns: list[tuple[str, str, str, str]] = []
            previous = None
            while len(turns) < MAX_TURNS:
                turn = await asyncio.to_thread(
                    _turn, url, f"{uuid.uuid4().hex}: next turn", previous
                )
                turns.append(turn)
                previous = turn[0]
                workers = {t[2] for t in turns[1:]}
                crossed = any(a[2] != b[2] for a, b in zip(turns, turns[1:], strict=False))
                if len(turns) >= MIN_TURNS and len(workers) == 2 and crossed:
                    break
            assert {t[1] for t in turns} == {turns[0][1]}, (turns, log.read_text()[-2000:])
            assert any(a[2] != b[2] for a, b in zip(turns, turns[1:], strict=False)), turns
            # Pinned by the map: the policy alone may pick one engine for idle requests too.
            assert all(f"reason={PIN_REASON};" in t[3] for t in turns[1:]), turns
            storing = [e for e in fleet if turns[-1][0] in e.responses_api.stored]
            assert [e.name for e in storing] == [turns[0][1]]

    h.run(main(), timeout=60.0)
