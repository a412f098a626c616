"""The minimal parse of Responses and Anthropic Messages bodies, as chat requests.

``POST /v1/responses`` (``instructions`` + ``input``) and ``POST /v1/messages``
(``system`` + ``messages``; also ``/v1/messages/count_tokens``) are routed like chat:
each is decoded into the fields routing reads and rendered to a
:class:`~fastroute.proxy.path.requests.ChatRequest`, so the routing key
(:mod:`~fastroute.proxy.path.routing_key`), the route prefix and the prompt estimate
treat them exactly as the chat messages they stand for:

=================================  ==============================================
body                               chat message
=================================  ==============================================
``instructions`` / ``system``      a ``system`` message (text blocks joined by
                                   ``"\\n"``)
``input`` as a string              one ``user`` message
``input`` item ``message``         its role; ``input_text``/``output_text`` parts
                                   are text parts, ``input_image`` an image part,
                                   ``input_file`` a file part
other ``input`` items              a message whose role is the item's type, its
                                   text the call's ``output``/``arguments``
Anthropic content blocks           ``text`` a text part; ``image`` an image part
                                   (URL, or the base64 data as a data URL);
                                   ``tool_use``/``tool_result`` their JSON/text
=================================  ==============================================

The proxy still forwards the client's bytes unchanged. Responses' ``max_output_tokens``
and Anthropic's ``max_tokens`` become ``max_tokens``; Anthropic's
``metadata.user_id`` is the ``user``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from fastroute.proxy.path.requests import (
    ChatRequest,
    ContentPart,
    FileRef,
    Message,
    _error,
    too_deep_error,
)

__all__ = ["ResponsesChat", "parse_responses", "parse_messages"]


class ResponsesChat(ChatRequest, kw_only=True):
    """A Responses body as a chat request, with the stored response it continues."""

    previous_response_id: str | None = None


class _InputPart(msgspec.Struct):
    type: str
    text: str | None = None
    image_url: str | None = None
    file_id: str | None = None
    file_data: str | None = None
    filename: str | None = None


class _InputItem(msgspec.Struct):
    type: str | None = None
    role: str | None = None
    content: str | list[_InputPart] | None = None
    output: Any = None
    arguments: str | None = None


class _ResponsesBody(msgspec.Struct):
    model: str | None = None
    stream: bool | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    max_output_tokens: int | None = None
    instructions: str | None = None
    input: str | list[_InputItem] = ""
    previous_response_id: str | None = None


class _Block(msgspec.Struct):
    type: str
    text: str | None = None
    source: dict[str, Any] | None = None
    name: str | None = None
    input: Any = None
    content: Any = None


class _AnthropicMessage(msgspec.Struct):
    role: str
    content: str | list[_Block]


class _Metadata(msgspec.Struct):
    user_id: str | None = None


class _MessagesBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    stream: bool | None = None
    max_tokens: int | None = None
    system: str | list[_Block] | None = None
    messages: list[_AnthropicMessage]
    metadata: _Metadata | None = None


_responses_decoder = msgspec.json.Decoder(_ResponsesBody)
_messages_decoder = msgspec.json.Decoder(_MessagesBody)
_encode = msgspec.json.encode


def _input_part(part: _InputPart) -> ContentPart:
    if part.type in ("input_text", "output_text", "text"):
        return ContentPart(type="text", text=part.text or "")
    if part.type == "input_image":
        return ContentPart(type="image_url", image_url=part.image_url or part.file_id or "")
    if part.type == "input_file":
        return ContentPart(
            type="file",
            file=FileRef(file_id=part.file_id, file_data=part.file_data, filename=part.filename),
        )
    return ContentPart(type=part.type, text=part.text)


def _input_message(item: _InputItem) -> Message:
    if item.type in (None, "message"):
        content = item.content
        if isinstance(content, list):
            return Message(role=item.role or "user", content=[_input_part(p) for p in content])
        return Message(role=item.role or "user", content=content)
    payload = item.output if item.output is not None else item.arguments
    text = payload if isinstance(payload, str) else _encode(payload).decode()
    return Message(role=item.type, content=text)


def parse_responses(body: bytes) -> ResponsesChat:
    """Decode a ``POST /v1/responses`` body into its chat form.

    Raises
    ------
    RequestParseError
        Malformed JSON or a field of the wrong type (the JSON path is named).
    """
    try:
        req = _responses_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise _error(exc) from None
    except RecursionError:
        raise too_deep_error() from None
    messages = []
    if req.instructions:
        messages.append(Message(role="system", content=req.instructions))
    if isinstance(req.input, str):
        if req.input:
            messages.append(Message(role="user", content=req.input))
    else:
        messages.extend(_input_message(item) for item in req.input)
    return ResponsesChat(
        model=req.model,
        stream=req.stream,
        user=req.user,
        prompt_cache_key=req.prompt_cache_key,
        max_tokens=req.max_output_tokens,
        messages=messages,
        previous_response_id=req.previous_response_id,
    )


def _block_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # a tool_result's content blocks
        return "\n".join(b.get("text", "") if isinstance(b, dict) else str(b) for b in value)
    return _encode(value).decode()


def _block_part(block: _Block) -> ContentPart:
    if block.type == "text":
        return ContentPart(type="text", text=block.text or "")
    if block.type == "image":
        source = block.source or {}
        url = source.get("url")
        if url is None:
            url = f"data:{source.get('media_type', '')};base64,{source.get('data', '')}"
        return ContentPart(type="image_url", image_url=str(url))
    if block.type == "tool_use":
        return ContentPart(type="text", text=f"{block.name or ''}{_block_text(block.input)}")
    if block.type == "tool_result":
        return ContentPart(type="text", text=_block_text(block.content))
    return ContentPart(type=block.type, text=block.text)


def _system_text(system: str | list[_Block] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system
    return "\n".join(b.text or "" for b in system if b.type == "text")


def parse_messages(body: bytes) -> ChatRequest:
    """Decode a ``POST /v1/messages`` (or ``/count_tokens``) body into its chat form.

    Raises
    ------
    RequestParseError
        Malformed JSON, a field of the wrong type or ``messages`` missing.
    """
    try:
        req = _messages_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise _error(exc) from None
    except RecursionError:
        raise too_deep_error() from None
    messages = []
    system = _system_text(req.system)
    if system:
        messages.append(Message(role="system", content=system))
    for m in req.messages:
        content = m.content
        if isinstance(content, list):
            messages.append(Message(role=m.role, content=[_block_part(b) for b in content]))
        else:
            messages.append(Message(role=m.role, content=content))
    return ChatRequest(
        model=req.model,
        stream=req.stream,
        user=req.metadata.user_id if req.metadata is not None else None,
        max_tokens=req.max_tokens,
        messages=messages,
    )
