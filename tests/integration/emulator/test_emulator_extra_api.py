"""The emulated engine's endpoints besides generation (vLLM 0.32's shapes), over real HTTP."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from fastroute.emulator.extra_api import AUDIO_BYTES_PER_SECOND, POOLING_DIMENSIONS
from fastroute.emulator.server import DEFAULT_MODEL_NAME, EmulatedFleet, EngineSpec
from fastroute.tokens import count_text_tokens, render_chat

pytestmark = pytest.mark.integration

MODEL = DEFAULT_MODEL_NAME


async def _post(s: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with s.post(url, json=body) as resp:
        return resp.status, await resp.json()


def test_tokenize_counts_like_prompt_tokens_and_detokenize_inverts(arun) -> None:
    """/tokenize's ids are the emulator's token stand-in: as many as a completion's
    prompt_tokens (chat: the rendered template), and /detokenize gives the text back."""

    async def main() -> None:
        async with (
            EmulatedFleet([EngineSpec(profile="h100")]) as fleet,
            aiohttp.ClientSession() as s,
        ):
            url = fleet.urls[0]
            prompt = "Tokenize this, please: ünïcode too."
            status, tok = await _post(s, url + "/tokenize", {"model": MODEL, "prompt": prompt})
            assert status == 200
            assert set(tok) == {"count", "max_model_len", "tokens", "token_strs"}
            assert tok["count"] == len(tok["tokens"]) == count_text_tokens(prompt)
            assert tok["max_model_len"] == fleet.engines[0].model.max_model_len
            status, detok = await _post(s, url + "/detokenize", {"tokens": tok["tokens"]})
            assert status == 200 and detok == {"prompt": prompt}
            messages = [{"role": "user", "content": "hi there"}]
            _, chat_tok = await _post(s, url + "/tokenize", {"messages": messages})
            assert chat_tok["count"] == count_text_tokens(render_chat(messages))
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
                done = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
            assert done.usage.prompt_tokens == tok["count"]
            assert (await _post(s, url + "/detokenize", {"tokens": [-1]}))[0] == 400
            assert (await _post(s, url + "/tokenize", {"model": "other", "prompt": "x"}))[0] == 404

    arun(main())


def test_pooling_score_rerank_classify_shapes(arun) -> None:
    """Pooling, score (+ /v1), rerank (+ /v1, /v2) and classify answer vLLM's shapes."""

    async def main() -> None:
        async with (
            EmulatedFleet([EngineSpec(profile="h100")]) as fleet,
            aiohttp.ClientSession() as s,
        ):
            url = fleet.urls[0]
            status, pooled = await _post(s, url + "/pooling", {"model": MODEL, "input": ["a", "b"]})
            assert status == 200 and pooled["object"] == "list" and pooled["model"] == MODEL
            assert [d["index"] for d in pooled["data"]] == [0, 1]
            assert all(len(d["data"]) == POOLING_DIMENSIONS for d in pooled["data"])
            for path in ("/score", "/v1/score"):
                status, scored = await _post(
                    s, url + path, {"model": MODEL, "text_1": "a b", "text_2": ["a b", "c d"]}
                )
                assert status == 200
                assert [(d["object"], d["score"]) for d in scored["data"]] == [
                    ("score", 1.0),
                    ("score", 0.0),
                ]
                assert scored["usage"]["prompt_tokens"] > 0
            for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
                body = {"query": "red fox", "documents": ["blue sky", "red fox", "fox"], "top_n": 2}
                status, ranked = await _post(s, url + path, body)
                assert status == 200 and set(ranked) == {"id", "model", "usage", "results"}
                assert [r["index"] for r in ranked["results"]] == [1, 2]
                assert ranked["results"][0]["document"] == {"text": "red fox"}
            status, classes = await _post(s, url + "/classify", {"input": "good"})
            assert status == 200
            (row,) = classes["data"]
            assert row["num_classes"] == 2 and abs(sum(row["probs"]) - 1.0) < 1e-9
            assert (await _post(s, url + "/score", {"text_1": "a"}))[0] == 400

    arun(main())


def test_audio_and_models_with_lora(arun) -> None:
    """Transcription through the official client; /v1/models lists a LoRA adapter with its
    base model as parent, and the adapter is accepted as a model."""

    async def main() -> None:
        spec = EngineSpec(profile="h100", lora_adapters=("sql-lora",))
        async with EmulatedFleet([spec]) as fleet:
            url = fleet.urls[0]
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
                models = await c.models.list()
                text = await c.audio.transcriptions.create(
                    model="sql-lora", file=("a.wav", b"\1" * (2 * AUDIO_BYTES_PER_SECOND))
                )
        by_id = {m.id: m for m in models.data}
        assert set(by_id) == {MODEL, "sql-lora"}
        assert by_id["sql-lora"].parent == MODEL and by_id[MODEL].parent is None
        assert by_id["sql-lora"].max_model_len == by_id[MODEL].max_model_len
        assert text.text == "emulated transcription of 2 s of audio by sql-lora"

    arun(main())
