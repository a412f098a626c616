"""The emulated engine's Responses and Anthropic Messages APIs over real HTTP on loopback:
vLLM 0.32's shapes, the official clients, stored conversations, and the engine model's
accounting (the same prompt tokens as the equivalent chat request)."""

from __future__ import annotations

import json

import aiohttp
import anthropic
import openai
import pytest

from fastroute.emulator.model import OutputLengthDistribution
from fastroute.emulator.server import DEFAULT_MODEL_NAME, EmulatedFleet, EngineSpec
from fastroute.tokens import render_chat, tokenize_text

pytestmark = pytest.mark.integration

MODEL = DEFAULT_MODEL_NAME
SHORT = OutputLengthDistribution(mu=1.4, sigma=0.2)


def _prompt_tokens(messages: list[dict[str, str]]) -> int:
    return tokenize_text(render_chat(messages)).num_tokens


def test_responses_store_previous_and_stream(arun) -> None:
    """A response's usage counts the chat rendering of instructions + input; a follow-up
    with ``previous_response_id`` is prompted with the stored conversation (longer, and
    a prefix-cache hit); the stream's events are vLLM's, in order, numbered; unknown ids
    are vLLM's 404."""

    async def main() -> None:
        async with EmulatedFleet([EngineSpec(profile="h100", output_lengths=SHORT)]) as fleet:
            async with openai.AsyncOpenAI(
                base_url=fleet.urls[0] + "/v1", api_key="x", max_retries=0
            ) as client:
                first = await client.responses.create(
                    model=MODEL, instructions="Be brief.", input="Hello there!"
                )
                messages = [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hello there!"},
                ]
                assert first.usage.input_tokens == _prompt_tokens(messages)
                assert first.output_text and first.usage.output_tokens >= 1
                stream = await client.responses.create(
                    model=MODEL, input="And then?", previous_response_id=first.id, stream=True
                )
                events = [e async for e in stream]
                types = [e.type for e in events]
                assert types[:4] == [
                    "response.created",
                    "response.in_progress",
                    "response.output_item.added",
                    "response.content_part.added",
                ]
                assert types[-4:] == [
                    "response.output_text.done",
                    "response.content_part.done",
                    "response.output_item.done",
                    "response.completed",
                ]
                assert [e.sequence_number for e in events] == list(range(len(events)))
                done = events[-1].response
                follow = [
                    *messages,
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "And then?"},
                ]
                assert done.usage.input_tokens == _prompt_tokens(follow)
                assert done.usage.input_tokens_details.cached_tokens > 0
                assert done.previous_response_id == first.id
                deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
                assert deltas == done.output_text
                assert (await client.responses.retrieve(done.id)).output_text == deltas
                with pytest.raises(openai.NotFoundError) as err:
                    await client.responses.create(
                        model=MODEL, input="x", previous_response_id="resp_nope"
                    )
                assert err.value.body == {
                    "message": "Response with id 'resp_nope' not found.",
                    "type": "invalid_request_error",
                    "param": "response_id",
                    "code": 404,
                }
                with pytest.raises(openai.BadRequestError):
                    await client.responses.cancel(first.id)

    arun(main())


def test_messages_create_stream_count_and_errors(arun) -> None:
    """Messages: the message object, the event sequence (text assembled = the final
    message), usage, count_tokens; errors in vLLM's Anthropic shape."""

    async def main() -> None:
        async with EmulatedFleet([EngineSpec(profile="h100", output_lengths=SHORT)]) as fleet:
            url = fleet.urls[0]
            async with anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0) as c:
                user = [{"role": "user", "content": "Hello there!"}]
                message = await c.messages.create(
                    model=MODEL, max_tokens=5, system="Be brief.", messages=user
                )
                chat = [{"role": "system", "content": "Be brief."}, *user]
                assert message.usage.input_tokens == _prompt_tokens(chat)
                assert 1 <= message.usage.output_tokens <= 5
                assert message.stop_reason in ("end_turn", "max_tokens")
                async with c.messages.stream(model=MODEL, max_tokens=8, messages=user) as stream:
                    text = "".join([t async for t in stream.text_stream])
                    final = await stream.get_final_message()
                assert text == final.content[0].text
                assert final.usage.output_tokens >= 1
                count = await c.messages.count_tokens(model=MODEL, messages=user)
                assert count.input_tokens == _prompt_tokens(user)
                with pytest.raises(anthropic.NotFoundError) as err:
                    await c.messages.create(model="nope", max_tokens=2, messages=user)
                assert err.value.body["type"] == "error"
                assert err.value.body["error"]["type"] == "NotFoundError"
            async with (
                aiohttp.ClientSession() as s,
                s.post(url + "/v1/messages", json={"model": MODEL, "stream": True,
                       "max_tokens": 3, "messages": user}) as r,
            ):  # fmt: skip
                raw = (await r.read()).decode()
            names = [
                line[len("event: ") :] for line in raw.splitlines() if line.startswith("event: ")
            ]
            assert names[:2] == ["message_start", "content_block_start"]
            assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
            data = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
            assert [d["type"] for d in data] == names

    arun(main())
