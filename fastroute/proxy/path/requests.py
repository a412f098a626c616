"""The minimal parse of an OpenAI request body: only what routing needs.

The proxy forwards the original body bytes unchanged (docs/design.md §3 step 1); these
Structs exist to classify, key and account the request, so they hold a handful of
fields and ignore every other one (msgspec drops unknown fields while decoding, at C
speed). Types are still checked for the fields kept, and any decode error becomes a
:class:`RequestParseError` that names the JSON path, ready for an OpenAI-style 400.

=========================  ========================================================
field                      accepted
=========================  ========================================================
``model``                  string (optional here: the classifier decides)
``stream``                 bool or null
``user``                   string or null
``prompt_cache_key``       string or null (OpenAI's explicit cache-routing key)
``max_tokens``             int or null
``max_completion_tokens``  int or null (chat)
``messages``               list of ``{"role": str, "content": str | [part] | null}``
                           (chat; required); a part is ``{"type": str, ...}`` with
                           ``text``, ``image_url`` (``{"url"}`` or a string),
                           ``input_audio`` (``{"data", "format"}``) or ``file``
``prompt``                 string, list of strings, list of token ids, or list of
                           lists of token ids (completions; required)
=========================  ========================================================
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from fastroute.errors import FastrouteError

__all__ = [
    "RequestParseError",
    "ImageURL",
    "InputAudio",
    "FileRef",
    "ContentPart",
    "Message",
    "ChatRequest",
    "CompletionRequest",
    "ParsedRequest",
    "parse_chat",
    "parse_completion",
    "too_deep_error",
]


class RequestParseError(FastrouteError, ValueError):
    """A request body the proxy cannot route: malformed JSON or a field of the wrong type.

    The message is written for the client and is sent as an OpenAI-style 400
    ``invalid_request_error``; see :meth:`to_openai_error`.

    Attributes
    ----------
    message : str
        What was expected and what was found, with the JSON path.
    path : str or None
        The JSON path msgspec reported (``"$.messages[0].role"``), ``"$"`` for the
        document itself, None when the JSON is not well-formed.
    param : str or None
        ``path`` without the leading ``$.``, as OpenAI's ``error.param`` carries it.
    """

    status = 400

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        if path is None or path == "$":
            self.param = None
        else:
            self.param = path[2:] if path.startswith("$.") else path[1:]

    def to_openai_error(self) -> dict[str, dict[str, str | None]]:
        """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": "invalid_request_error",
                "param": self.param,
                "code": None,
            }
        }


class ImageURL(msgspec.Struct):
    """``image_url`` of an image content part."""

    url: str


class InputAudio(msgspec.Struct):
    """``input_audio`` of an audio content part."""

    data: str
    format: str | None = None


class FileRef(msgspec.Struct):
    """``file`` of a file content part (by id, or inline data)."""

    file_id: str | None = None
    file_data: str | None = None
    filename: str | None = None


class ContentPart(msgspec.Struct):
    """One element of a message's ``content`` list."""

    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None
    input_audio: InputAudio | None = None
    file: FileRef | None = None


class Message(msgspec.Struct):
    """One chat message: its role and content (other fields are ignored)."""

    role: str
    content: str | list[ContentPart] | None = None


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None
    stream: bool | None = None
    #: UNSET when the body has no ``stream_options`` key (see ``sse.ask_for_usage``).
    stream_options: dict[str, Any] | None | msgspec.UnsetType = msgspec.UNSET
    user: str | None = None
    prompt_cache_key: str | None = None
    max_tokens: int | None = None


class ChatRequest(_Common, kw_only=True):
    """The fields of ``POST /v1/chat/completions`` routing reads."""

    messages: list[Message]
    max_completion_tokens: int | None = None

    @property
    def max_output_tokens(self) -> int | None:
        """``max_completion_tokens`` if given, else the legacy ``max_tokens``."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class CompletionRequest(_Common, kw_only=True):
    """The fields of ``POST /v1/completions`` routing reads.

    ``prompt`` keeps the shape it was sent in: a string, or a list whose elements are
    all strings, all token ids (one prompt) or all lists of token ids (a batch).
    """

    prompt: str | list[str | int | list[int]]

    @property
    def max_output_tokens(self) -> int | None:
        """``max_tokens``."""
        return self.max_tokens


#: Either parsed request.
ParsedRequest = ChatRequest | CompletionRequest

_chat_decoder = msgspec.json.Decoder(ChatRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_PATH = re.compile(r" - at `(\$[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `([^`]+)`")


def _error(exc: msgspec.DecodeError) -> RequestParseError:
    text = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        m = _PATH.search(text)
        path = m.group(1) if m else "$"
        detail = text[: m.start()] if m else text
        missing = _MISSING.match(detail)
        if missing:  # point at the missing field itself, as OpenAI's `param` does
            path = f"{path}.{missing.group(1)}"
        return RequestParseError(f"Invalid request body: {detail} - at `{path}`", path)
    return RequestParseError(f"Invalid request body: {text}", None)


def too_deep_error() -> RequestParseError:
    """The 400 for a body nested past the decoder's recursion limit.

    msgspec (like ``json``) decodes recursively, even while skipping an unknown field,
    so ``[[[...]]]`` 100,000 deep raises ``RecursionError``; that is the client's input,
    not a proxy fault. Catching it costs nothing per request, unlike a depth pre-scan.
    """
    return RequestParseError("Invalid request body: JSON nested too deeply", None)


def _check_prompt(req: CompletionRequest) -> None:
    prompt = req.prompt
    if isinstance(prompt, str) or not prompt:
        return
    first = type(prompt[0])
    for i, item in enumerate(prompt):
        if type(item) is not first:
            raise RequestParseError(
                "Invalid request body: `prompt` must be a string, a list of strings, a list "
                f"of token ids or a list of token-id lists, not a mix; element {i} is "
                f"`{type(item).__name__}` but element 0 is `{first.__name__}` "
                f"- at `$.prompt[{i}]`",
                f"$.prompt[{i}]",
            )


def parse_chat(body: bytes | bytearray | memoryview | str) -> ChatRequest:
    """Decode a chat-completions body.

    Raises
    ------
    RequestParseError
        Malformed JSON, nested too deeply, a field of the wrong type, or ``messages``
        missing.
    """
    try:
        return _chat_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise _error(exc) from None
    except RecursionError:
        raise too_deep_error() from None


def parse_completion(body: bytes | bytearray | memoryview | str) -> CompletionRequest:
    """Decode a completions body.

    Raises
    ------
    RequestParseError
        Malformed JSON, a field of the wrong type, ``prompt`` missing or mixing shapes.
    """
    try:
        req = _completion_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise _error(exc) from None
    except RecursionError:
        raise too_deep_error() from None
    _check_prompt(req)
    return req
