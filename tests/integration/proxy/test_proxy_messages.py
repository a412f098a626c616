"""``/v1/messages`` and ``/v1/messages/count_tokens`` through the proxy, with the official
``anthropic`` client: answers, streams, usage, and every error the proxy makes in
Anthropic's shape (the client's typed exceptions)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import anthropic
import pytest
from proxy_harness import MODEL, Harness, config_toml, decision_record, serve_proxy

from fastroute.config import decode_config
from fastroute.emulator.server import EmulatedFleet, fleet_specs
from fastroute.hashing import engine_id
from fastroute.proxy.path.fleet import class_key
from fastroute.tables import TableWriter

pytestmark = pytest.mark.integration

#: Holds an engine's requests open (≈0.7 s per token) until the fault is cleared.
HOLD = 100.0


def _client(url: str, api_key: str = "x") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=api_key, max_retries=0, timeout=15.0)


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _assert_anthropic_error(err: anthropic.APIStatusError, status: int, etype: str) -> None:
    assert err.status_code == status
    assert err.body["type"] == "error", err.body
    assert err.body["error"]["type"] == etype, err.body
    assert err.body["error"]["message"]


def test_messages_create_stream_and_count_tokens(h: Harness) -> None:
    """``messages.create`` and ``messages.stream`` parse; the text assembled from the
    stream is the engine's, the usage the engine's; the proxy measured the stream
    token-true (the engine's output tokens); ``count_tokens`` answers."""

    async def main() -> None:
        async with h.proxy_stack(2) as st, aiohttp.ClientSession() as s:
            client = _client(st.url)

            def calls() -> tuple[Any, str, Any, str, Any]:
                message = client.messages.create(
                    model=MODEL, max_tokens=6, system="Be terse.", messages=_user("Hi")
                )
                with client.messages.stream(
                    model=MODEL,
                    max_tokens=8,
                    system=[{"type": "text", "text": "Be terse."}],
                    messages=_user("Tell me"),
                ) as stream:
                    text = "".join(stream.text_stream)
                    final = stream.get_final_message()
                    rid = stream.response.headers["x-request-id"]
                count = client.messages.count_tokens(model=MODEL, messages=_user("Tell me"))
                return message, text, final, rid, count

            message, text, final, rid, count = await asyncio.to_thread(calls)
            assert message.type == "message" and message.role == "assistant"
            assert message.stop_reason in ("end_turn", "max_tokens")
            assert 1 <= message.usage.output_tokens <= 6
            assert message.content[0].text
            assert text == final.content[0].text and text
            assert final.usage.output_tokens >= 1 and final.usage.input_tokens > 0
            record = await decision_record(s, st.url, rid)
            (attempt,) = record["attempts"]
            assert attempt["output_tokens"] == final.usage.output_tokens
            assert record["timings"]["first_token"] > 0
            assert count.input_tokens > 0

    h.run(main())


def test_messages_errors_are_anthropic_shaped(h: Harness) -> None:
    """400 malformed, 404 unknown model, 413 too large: the proxy's own errors, raised by
    the client as its typed exceptions with Anthropic's body."""

    async def main() -> None:
        async with h.proxy_stack(1, extra="[limits]\nmax_body_bytes = 2048\n") as st:
            client = _client(st.url)

            def expect(exc: type[anthropic.APIStatusError], **body: Any) -> Any:
                with pytest.raises(exc) as err:
                    client.messages.create(**body)
                return err.value

            bad = await asyncio.to_thread(
                expect, anthropic.BadRequestError, model=MODEL, max_tokens=4, messages="nope"
            )
            _assert_anthropic_error(bad, 400, "invalid_request_error")
            unknown = await asyncio.to_thread(
                expect, anthropic.NotFoundError, model="nope", max_tokens=4, messages=_user("x")
            )
            _assert_anthropic_error(unknown, 404, "not_found_error")
            large = await asyncio.to_thread(
                expect,
                anthropic.RequestTooLargeError,
                model=MODEL,
                max_tokens=4,
                messages=_user("x" * 4096),
            )
            _assert_anthropic_error(large, 413, "request_too_large")
            engine = await asyncio.to_thread(
                expect, anthropic.BadRequestError, model=MODEL, max_tokens=0, messages=_user("x")
            )  # the engine's own 400, converted
            _assert_anthropic_error(engine, 400, "invalid_request_error")
            assert "max_tokens" in engine.body["error"]["message"]

    h.run(main())


#: A second request in flight is refused: the engine at its cap, or no admission slot.
_LIMITS = {
    "at_cap": ("[admission]\nmax_wait_s = 0.3\n", "max_concurrency = 1\n", "concurrency limit"),
    "admission": (
        "[admission]\nmax_wait_s = 0.3\nmax_queue_len = 1\n[limits]\nmax_concurrent_requests = 1\n",
        "",
        "overloaded",
    ),
}


@pytest.mark.parametrize("limit", sorted(_LIMITS))
def test_messages_over_a_limit_is_a_rate_limit_error(h: Harness, limit: str) -> None:
    """The only engine at its ``max_concurrency``, or the proxy's only admission slot
    taken: a second request waits ``admission.max_wait_s``, then gets 429 as Anthropic's
    ``rate_limit_error``."""
    extra, engine_line, says = _LIMITS[limit]

    async def main() -> None:
        specs = fleet_specs(1, model_name=MODEL, profile="h100")
        async with EmulatedFleet(specs) as fleet:
            toml = config_toml(fleet.urls, extra=extra)
            toml = toml.replace("capacity_rps = 10.0\n", "capacity_rps = 10.0\n" + engine_line)
            async with serve_proxy(decode_config(toml, source="t.toml")) as (app, url, _):
                await fleet[0].set_faults(slowdown=HOLD)
                client = _client(url)
                held = asyncio.create_task(
                    asyncio.to_thread(
                        client.messages.create, model=MODEL, max_tokens=2, messages=_user("hold")
                    )
                )
                await h.wait_until(lambda: app.context.metrics.in_flight_count == 1)
                with pytest.raises(anthropic.RateLimitError) as err:
                    await asyncio.to_thread(
                        client.messages.create, model=MODEL, max_tokens=2, messages=_user("next")
                    )
                _assert_anthropic_error(err.value, 429, "rate_limit_error")
                assert says in err.value.body["error"]["message"]
                assert int(err.value.response.headers["Retry-After"]) >= 1
                await fleet[0].clear_faults()
                assert (await held).content[0].text

    h.run(main())


def test_messages_engine_failures_are_5xx_api_errors(h: Harness) -> None:
    """An engine answering 500 is the proxy's 502; an engine that does not answer in
    time its 504; a stream the engine breaks ends with an Anthropic ``event: error``."""

    async def main() -> None:
        timeouts = {"first_byte_timeout_s": 0.5}
        async with h.proxy_stack(1, timeouts=timeouts) as st:
            client = _client(st.url)
            engine = st.fleet[0]
            await engine.set_faults(error_rate=1.0, error_status=500)
            with pytest.raises(anthropic.InternalServerError) as err:
                await asyncio.to_thread(
                    client.messages.create, model=MODEL, max_tokens=2, messages=_user("x")
                )
            _assert_anthropic_error(err.value, 502, "api_error")
            await engine.set_faults(error_rate=0.0, hang=True)
            with pytest.raises(anthropic.InternalServerError) as err:
                await asyncio.to_thread(
                    client.messages.create, model=MODEL, max_tokens=2, messages=_user("y")
                )
            _assert_anthropic_error(err.value, 504, "api_error")
            await engine.clear_faults()
            await engine.set_faults(crash_after_tokens=2)

            def broken_stream() -> list[Any]:
                events = []
                with pytest.raises(anthropic.APIStatusError) as err:
                    stream = client.messages.create(
                        model=MODEL, max_tokens=8, messages=_user("z"), stream=True
                    )
                    events.extend(stream)
                assert err.value.body["type"] == "error", err.value.body
                return events

            events = await asyncio.to_thread(broken_stream)
            assert [e.type for e in events][:1] == ["message_start"]

    h.run(main())


def test_messages_x_api_key_is_the_tenant_key(h: Harness) -> None:
    """With tenants and no default tenant, Anthropic's ``x-api-key`` names the tenant
    (the client sends no bearer token); an unknown key is a 401 ``authentication_error``."""

    async def main() -> None:
        extra = '[[tenants]]\nname = "acme"\napi_keys = ["sk-acme-0123456789"]\n'
        async with h.proxy_stack(1, extra=extra) as st:
            ok = await asyncio.to_thread(
                _client(st.url, api_key="sk-acme-0123456789").messages.create,
                model=MODEL,
                max_tokens=2,
                messages=_user("x"),
            )
            assert ok.content[0].text
            with pytest.raises(anthropic.AuthenticationError) as err:
                await asyncio.to_thread(
                    _client(st.url, api_key="sk-wrong-0123456789").messages.create,
                    model=MODEL,
                    max_tokens=2,
                    messages=_user("x"),
                )
            _assert_anthropic_error(err.value, 401, "authentication_error")

    h.run(main())


def test_messages_over_the_tenant_limit_is_a_rate_limit_error(h: Harness) -> None:
    """A tenant over its requests_per_min: Anthropic's ``rate_limit_error`` with the
    ``retry-after`` and ``x-ratelimit-*`` headers (docs/tenancy.md)."""

    async def main() -> None:
        extra = (
            '[[tenants]]\nname = "acme"\napi_keys = ["sk-acme-0123456789"]\nrequests_per_min = 1\n'
        )
        async with h.proxy_stack(1, extra=extra) as st:
            client = _client(st.url, api_key="sk-acme-0123456789")
            call = client.messages.create
            await asyncio.to_thread(call, model=MODEL, max_tokens=2, messages=_user("x"))
            with pytest.raises(anthropic.RateLimitError) as err:
                await asyncio.to_thread(call, model=MODEL, max_tokens=2, messages=_user("y"))
            _assert_anthropic_error(err.value, 429, "rate_limit_error")
            headers = err.value.response.headers
            assert int(headers["retry-after"]) >= 1
            assert headers["x-ratelimit-limit-requests"] == "1"
            assert headers["x-ratelimit-remaining-requests"] == "0"

    h.run(main())


def test_messages_no_engine_is_an_overloaded_error(h: Harness, shm_name: str) -> None:
    """No eligible engine (the weight table gives the class none): the proxy's 503 as
    Anthropic's ``overloaded_error``."""

    async def main() -> None:
        key = class_key("local", MODEL, "default")
        with TableWriter(shm_name, max_engines=8, max_classes=8) as writer:
            writer.publish([engine_id("engine-0")], [[0.0]], class_keys=[key])
            async with h.proxy_stack(1, table_name=shm_name) as st:
                with pytest.raises(anthropic.InternalServerError) as err:
                    await asyncio.to_thread(
                        _client(st.url).messages.create,
                        model=MODEL,
                        max_tokens=2,
                        messages=_user("x"),
                    )
                _assert_anthropic_error(err.value, 503, "overloaded_error")
            writer.unlink()

    h.run(main())
