"""The load driver against a tiny real aiohttp server on 127.0.0.1 (no mocks)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Coroutine
from typing import Any

import pytest
from loadgen_server import ChatServer

from fastroute.loadgen import DriveOptions, LoadDriver
from fastroute.loadgen.client import error_code
from fastroute.workload import Session, Turn

pytestmark = pytest.mark.integration


def run(coro: Coroutine[Any, Any, Any], timeout: float = 20.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def session(
    sid: str, *, turns: int = 2, start_s: float = 0.0, think_s: float = 0.0, source: str = "east"
) -> Session:
    return Session(
        session_id=sid,
        tenant="acme",
        source=source,
        model="m",
        start_s=start_s,
        system_prompt="you are terse",
        turns=tuple(
            Turn(user_text=f"{sid} question {i}", user_tokens=4, max_tokens=3, think_s=think_s)
            for i in range(turns)
        ),
    )


def test_streamed_turns_carry_the_real_replies_and_are_timed() -> None:
    """Turn 2's messages hold turn 1's streamed reply; TTFT/TBOT/usage/engine are recorded."""

    async def main() -> None:
        async with ChatServer("eng-a", tokens=3, gap_s=0.01) as srv:
            result = await LoadDriver(srv.url, DriveOptions()).run([session("s1")])
            assert len(result.records) == 2
            first, second = sorted(result.records, key=lambda r: r.turn)
            assert first.ok and second.ok
            assert first.engine == "eng-a"
            assert first.output_tokens == 3
            assert first.ttft_s is not None and first.tbot_s is not None
            assert first.max_gap_s is not None and first.max_gap_s >= first.tbot_s
            assert first.e2e_s is not None and first.e2e_s >= first.ttft_s
            assert first.prompt_tokens == 40 and first.cached_tokens == 16
            messages = srv.bodies[1]["messages"]
            assert messages[0] == {"role": "system", "content": "you are terse"}
            assert messages[2] == {"role": "assistant", "content": srv.reply_text(0)}
            assert messages[-1]["content"] == "s1 question 1"
            assert srv.bodies[0]["stream"] is True and srv.bodies[0]["ignore_eos"] is True
            assert srv.bodies[0]["max_tokens"] == 3
            assert result.sessions_started == result.sessions_completed == 1

    run(main())


def test_think_time_separates_a_reply_from_the_next_turn() -> None:
    """The next turn is sent no earlier than think_s after the previous reply ended."""

    async def main() -> None:
        async with ChatServer() as srv:
            result = await LoadDriver(srv.url).run([session("s1", think_s=0.2)])
            first, second = sorted(result.records, key=lambda r: r.turn)
            assert first.e2e_s is not None
            assert second.sent_at_s - (first.sent_at_s + first.e2e_s) >= 0.2

    run(main())


def test_session_header_is_sent_only_when_asked() -> None:
    async def main() -> None:
        async with ChatServer() as srv:
            await LoadDriver(srv.url).run([session("s1", turns=1)])
            assert "x-session-id" not in {k.lower() for k in srv.headers[0]}
            opts = DriveOptions(send_session_id=True, session_header="x-conv")
            await LoadDriver(srv.url, opts).run([session("s2", turns=1)])
            assert srv.headers[1]["x-conv"] == "s2"

    run(main())


def test_non_streaming_uses_usage_and_has_no_ttft() -> None:
    async def main() -> None:
        async with ChatServer(tokens=5) as srv:
            opts = DriveOptions(stream=False, ignore_eos=False)
            result = await LoadDriver(srv.url, opts).run([session("s1")])
            rec = result.records[0]
            assert rec.ok and rec.output_tokens == 5 and rec.ttft_s is None
            assert "stream_options" not in srv.bodies[0] and "ignore_eos" not in srv.bodies[0]
            assert srv.bodies[1]["messages"][2]["content"] == srv.reply_text(0)

    run(main())


@pytest.mark.parametrize(
    ("mode", "kind"),
    [("status", "http_429"), ("cut", "disconnected"), ("sse_error", "stream_error")],
)
def test_a_failed_turn_is_recorded_and_ends_its_session(mode: str, kind: str) -> None:
    async def main() -> None:
        async with ChatServer(tokens=4) as srv:
            srv.mode = mode
            result = await LoadDriver(srv.url).run([session("s1", turns=3)])
            assert [r.error for r in result.records] == [kind]
            assert len(srv.bodies) == 1
            assert result.sessions_completed == 0

    run(main())


@pytest.mark.parametrize(
    ("code", "recorded"), [(429, "429"), ("load_shed", "load_shed"), (None, None)]
)
def test_an_error_status_records_its_body_code(
    code: str | int | None, recorded: str | None
) -> None:
    async def main() -> None:
        async with ChatServer() as srv:
            srv.mode, srv.error_code = "status", code
            result = await LoadDriver(srv.url).run([session("s1")])
            rec = result.records[0]
            assert (rec.error, rec.error_code) == ("http_429", recorded)

    run(main())


def test_connection_refused_is_a_connect_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connect is refused

        async def main() -> None:
            result = await LoadDriver(f"http://127.0.0.1:{port}").run([session("s1")])
            assert [r.error for r in result.records] == ["connect"]
            assert result.records[0].status == 0

        run(main())


def test_request_cap_and_in_flight_bound() -> None:
    """No more than max_requests are sent, and no more than max_in_flight at once."""

    async def main() -> None:
        async with ChatServer(tokens=2, gap_s=0.02) as srv:
            opts = DriveOptions(max_requests=7, max_in_flight=2)
            sessions = [session(f"s{i}", turns=3) for i in range(6)]
            result = await LoadDriver(srv.url, opts).run(sessions)
            assert len(srv.bodies) == len(result.records) == 7
            assert srv.peak_in_flight <= 2
            assert max(r.queued_s for r in result.records) > 0

    run(main())


def test_deadline_cancels_requests_still_in_flight_after_the_drain() -> None:
    async def main() -> None:
        async with ChatServer() as srv:
            srv.mode = "hang"
            opts = DriveOptions(duration_s=0.2, drain_s=0.1)
            result = await LoadDriver(srv.url, opts).run([session("s1"), session("s2")])
            assert sorted(r.error for r in result.records) == ["deadline", "deadline"]
            assert result.wall_s < 5.0  # bounded by duration + drain, not by the server

    run(main())


def test_stop_ends_the_run_early() -> None:
    async def main() -> None:
        async with ChatServer() as srv:
            srv.mode = "hang"
            driver = LoadDriver(srv.url, DriveOptions(drain_s=0.0))
            task = asyncio.create_task(driver.run([session("s1")]))
            while not srv.bodies:
                await asyncio.sleep(0.01)
            driver.stop()
            result = await task
            assert result.stopped_early
            assert [r.error for r in result.records] == ["deadline"]

    run(main())


def test_open_loop_starts_sessions_at_their_start_times() -> None:
    async def main() -> None:
        async with ChatServer() as srv:
            sessions = [session("late", turns=1, start_s=0.3), session("early", turns=1)]
            result = await LoadDriver(srv.url).run(sessions)
            by_id = {r.session_id: r for r in result.records}
            assert by_id["late"].sent_at_s >= 0.3
            assert by_id["early"].sent_at_s < by_id["late"].sent_at_s

    run(main())


def test_open_loop_drops_arrivals_beyond_the_live_session_bound() -> None:
    async def main() -> None:
        async with ChatServer() as srv:
            srv.hold = asyncio.Event()
            opts = DriveOptions(max_live_sessions=2)
            task = asyncio.create_task(
                LoadDriver(srv.url, opts).run([session(f"s{i}", turns=1) for i in range(5)])
            )
            while len(srv.bodies) < 2:
                await asyncio.sleep(0.01)
            srv.hold.set()
            result = await task
            assert result.sessions_dropped == 3 and len(result.records) == 2

    run(main())


def test_closed_loop_keeps_n_sessions_going() -> None:
    """Closed loop ignores start_s and never has more than N sessions in flight."""

    async def main() -> None:
        async with ChatServer(tokens=2, gap_s=0.01) as srv:
            opts = DriveOptions(concurrency=3)
            sessions = [session(f"s{i}", start_s=100.0) for i in range(8)]
            result = await LoadDriver(srv.url, opts).run(sessions)
            assert result.sessions_completed == 8 and len(result.records) == 16
            assert srv.peak_in_flight == 3

    run(main())


def test_each_source_goes_to_its_own_url() -> None:
    async def main() -> None:
        async with ChatServer("east-0") as east, ChatServer("west-0") as west:
            driver = LoadDriver({"east": east.url, "west": west.url})
            sessions = [session("a", turns=1), session("b", turns=1, source="west")]
            result = await driver.run(sessions)
            assert {r.source: r.engine for r in result.records} == {
                "east": "east-0",
                "west": "west-0",
            }
            with pytest.raises(KeyError, match="no target URL for source cluster 'north'"):
                await driver.run([session("c", source="north")])

    run(main())


def test_a_source_with_several_urls_sends_its_requests_to_them_in_turn() -> None:
    """Several proxies behind a stateless balancer: request by request, so consecutive
    turns of one session go to different proxies."""

    async def main() -> None:
        async with ChatServer("p-0") as p0, ChatServer("p-1") as p1:
            driver = LoadDriver({"east": [p0.url, p1.url]}, DriveOptions(concurrency=1))
            result = await driver.run([session("a", turns=4), session("b", turns=2)])
            engines = [r.engine for r in sorted(result.records, key=lambda r: r.sent_at_s)]
            assert engines == ["p-0", "p-1"] * 3
        with pytest.raises(ValueError, match="source 'east' has an empty list"):
            LoadDriver({"east": []})

    run(main())


def test_bad_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="max_in_flight"):
        DriveOptions(max_in_flight=0)
    with pytest.raises(ValueError, match="concurrency"):
        DriveOptions(concurrency=0)
    with pytest.raises(ValueError, match="targets"):
        LoadDriver({})


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b'{"error": {"message": "m", "code": "load_shed"}}', "load_shed"),
        (b'{"object": "error", "message": "m", "code": 429}', "429"),  # SGLang's flat shape
        (b'{"error": "busy"}', None),
        (b'{"error": {"code": true}}', None),
        (b"<html>busy</html>", None),
        (b"[1]", None),
    ],
)
def test_error_code_reads_both_error_shapes(body: bytes, code: str | None) -> None:
    assert error_code(body) == code
