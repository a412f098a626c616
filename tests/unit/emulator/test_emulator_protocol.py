"""Wire format: request validation errors and OpenAI chunk encoding."""

from __future__ import annotations

import json

import pytest

from fastroute.emulator.protocol import (
    ChunkEncoder,
    RequestError,
    decode_chat,
    decode_completion,
    error_body,
    usage_dict,
)

_MSG = [{"role": "user", "content": "hi"}]


def _chat(**fields) -> bytes:
    return json.dumps({"messages": _MSG, **fields}).encode()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b'{"model": "m"}', "messages"),
        (b'{"messages": []}', "messages"),
        (b'{"messages": "hi"}', None),
        (_chat(max_tokens=-1), "max_tokens"),
        (_chat(max_tokens=0), "max_tokens"),
        (_chat(max_completion_tokens=0), "max_completion_tokens"),
        (_chat(n=2), "n"),
        (_chat(min_tokens=-1), "min_tokens"),
        (_chat(max_tokens=3, min_tokens=5), "min_tokens"),
        (_chat(continue_final_message=True), None),  # with add_generation_prompt: vLLM's 400
        (_chat(continue_final_message=True, add_generation_prompt=False), "messages"),
    ],
)
def test_bad_chat_requests_are_400(body, param):
    """Malformed, incomplete or out-of-range chat requests raise a 400 RequestError."""
    with pytest.raises(RequestError) as info:
        decode_chat(body)
    assert info.value.status == 400 and info.value.param == param


def test_chat_continuation_fields():
    """A partial final assistant turn to continue, without a generation prompt."""
    messages = [*_MSG, {"role": "assistant", "content": " the"}]
    body = json.dumps(
        {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    )
    req = decode_chat(body.encode())
    assert req.continue_final_message and not req.add_generation_prompt
    plain = decode_chat(_chat())
    assert not plain.continue_final_message and plain.add_generation_prompt


def test_chat_accepts_unknown_fields_and_prefers_max_completion_tokens():
    """Extra fields are ignored; max_completion_tokens overrides max_tokens."""
    req = decode_chat(_chat(temperature=0.3, foo={"x": 1}, max_tokens=9, max_completion_tokens=4))
    assert req.max_tokens == 4 and req.n == 1 and not req.stream


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("abc", "abc"), ([1, 2, 3], [1, 2, 3]), (["abc"], "abc"), ([[4, 5]], [4, 5])],
)
def test_completion_prompt_forms(prompt, expected):
    """A string, a list of ids, or a batch of one of those is accepted."""
    assert decode_completion(json.dumps({"prompt": prompt}).encode()).prompt == expected


@pytest.mark.parametrize("prompt", [["a", "b"], [], [1, "x"], 5])
def test_completion_rejects_batches_and_junk(prompt):
    """Batches of several prompts and mixed lists are a 400."""
    with pytest.raises(RequestError) as info:
        decode_completion(json.dumps({"prompt": prompt}).encode())
    assert info.value.status == 400


def test_missing_prompt_is_400():
    """A completion without prompt names the field."""
    with pytest.raises(RequestError) as info:
        decode_completion(b'{"model": "m"}')
    assert info.value.param == "prompt"


def test_error_body_has_vllm_shape():
    """{"error": {message, type, param, code}} with code = HTTP status."""
    body = json.loads(error_body(404, "The model `x` does not exist.", "model"))
    assert body == {
        "error": {
            "message": "The model `x` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


def _parse(chunk: bytes) -> dict:
    assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
    return json.loads(chunk[6:])


def test_chat_chunks_follow_openai_format():
    """Role chunk, content chunks, last chunk with finish_reason, usage chunk without choices."""
    enc = ChunkEncoder(True, "chatcmpl-1", 123, "m")
    role = _parse(enc.role())
    assert role["object"] == "chat.completion.chunk" and role["created"] == 123
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tok = _parse(enc.token(' "quoted"\n'))
    assert tok["choices"][0]["delta"] == {"content": ' "quoted"\n'}
    assert tok["choices"][0]["finish_reason"] is None
    last = _parse(enc.last(" end", "stop", {"kv_transfer_params": {"a": 1}}))
    assert last["choices"][0]["finish_reason"] == "stop"
    assert last["kv_transfer_params"] == {"a": 1}
    usage = _parse(enc.usage(usage_dict(10, 3, 8)))
    assert usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": 10,
        "total_tokens": 13,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 8},
    }


def test_completion_chunks_carry_text():
    """text_completion chunks put the token in choices[0].text."""
    enc = ChunkEncoder(False, "cmpl-1", 1, "m")
    tok = _parse(enc.token("x"))
    assert tok["object"] == "text_completion" and tok["choices"][0]["text"] == "x"
    assert _parse(enc.last("y", "length"))["choices"][0]["finish_reason"] == "length"
