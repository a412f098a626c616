"""Engine error bodies through the proxy: the client gets the engine's message, type,
param and code whatever the engine's error shape (vLLM's wrapped body, SGLang's flat one)."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
from proxy_harness import MODEL, Harness

pytestmark = pytest.mark.integration

#: vLLM's check (``SamplingParams._verify_args``), which the emulator makes too.
MESSAGE = "min_tokens must be less than or equal to max_tokens=2, got 10."


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_an_engine_400_reaches_the_openai_client_with_its_message_and_code(
    h: Harness, kind: str
) -> None:
    async def main() -> None:
        async with (
            h.proxy_stack(1, engine_options={"kind": kind}) as stack,
            aiohttp.ClientSession() as s,
        ):
            body = h.chat_body("too short", max_tokens=2, min_tokens=10)
            async with s.post(stack.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 400
                assert await r.json() == {
                    "error": {
                        "message": MESSAGE,
                        "type": "BadRequestError",
                        "param": "min_tokens",
                        "code": 400,
                    }
                }
            client = stack.client()

            def call() -> None:
                client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "too short"}],
                    max_tokens=2,
                    extra_body={"min_tokens": 10},
                )

            with pytest.raises(openai.BadRequestError) as caught:
                await asyncio.to_thread(call)
            assert caught.value.message.endswith(MESSAGE)
            assert caught.value.code == "400"  # the client turns the integer into a str
            assert isinstance(caught.value.body, dict) and caught.value.body["code"] == 400
            assert caught.value.param == "min_tokens"
            assert caught.value.type == "BadRequestError"

    h.run(main())
