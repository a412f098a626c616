"""The engine endpoints besides chat, completions and embeddings: one table, one parse each.

Every endpoint here runs the request path of
:class:`~fastroute.proxy.path.endpoint_handler.EndpointHandler` (the inference path with
two differences: its own parse, and least-loaded routing) and forwards the body bytes
unchanged to the same path on the chosen engine. An endpoint is a row of
:data:`ENDPOINTS`: the path, its kind (what it is, for records and docs), how its body
names the model, and which body limit holds it.

=============================================  ==========  =======================================
path                                           kind        body, ``model`` from
=============================================  ==========  =======================================
``/tokenize``, ``/detokenize``                 tokenizer   JSON ``model``
``/pooling``, ``/classify``                    pooling     JSON ``model``
``/score``, ``/v1/score``                      pooling     JSON ``model``
``/rerank``, ``/v1/rerank``, ``/v2/rerank``    pooling     JSON ``model``
``/v1/audio/transcriptions``, ``.../translations``  audio  ``multipart/form-data`` field ``model``
``proxy.passthrough_paths`` (``POST /v1/...``)  passthrough  JSON ``model``
=============================================  ==========  =======================================

All of them are routed to the least-loaded eligible engine of the model (``least-request``:
fewest requests in flight host-wide, ties by weighted rendezvous order of the request id),
whatever the class's policy: a tokenizer call needs no affinity, and pooling, scoring and
audio requests build no KV cache worth returning to. ``model`` is required (vLLM falls back to
its only model; a proxy has many): missing → 400. Audio bodies are held to
``limits.max_audio_body_bytes`` instead of ``limits.max_body_bytes``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import msgspec

from fastroute.config import Config
from fastroute.proxy.path.multipart import MultipartError, form_field
from fastroute.proxy.path.requests import CompletionRequest, RequestParseError, too_deep_error

__all__ = [
    "Endpoint",
    "ENDPOINTS",
    "AUDIO_PREFIX",
    "PASSTHROUGH",
    "endpoint_for",
    "passthrough_allows",
    "parse_json_model",
    "parse_form_model",
]

#: Paths of the audio endpoints start with this (the front end's body limit reads it).
AUDIO_PREFIX = "/v1/audio/"

#: Reads a body (and the request headers) into the fields routing needs.
BodyParser = Callable[[bytes, Mapping[str, str]], CompletionRequest]


class _ModelOnly(msgspec.Struct):
    """The fields of a JSON endpoint body routing reads."""

    model: str | None = None
    user: str | None = None


_model_decoder = msgspec.json.Decoder(_ModelOnly)


def parse_json_model(body: bytes, headers: Mapping[str, str]) -> CompletionRequest:
    """A JSON body's ``model`` (and ``user``), as a prompt-less completion request.

    Raises
    ------
    RequestParseError
        Not JSON, not an object, or ``model``/``user`` not strings.
    """
    try:
        req = _model_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise RequestParseError(f"Invalid request body: {exc}", None) from None
    except RecursionError:
        raise too_deep_error() from None
    return CompletionRequest(model=req.model, user=req.user, prompt="")


def parse_form_model(body: bytes, headers: Mapping[str, str]) -> CompletionRequest:
    """A ``multipart/form-data`` body's ``model`` field, as a prompt-less completion request.

    Raises
    ------
    RequestParseError
        Not multipart/form-data, or malformed as far as it was scanned.
    """
    try:
        model = form_field(body, headers.get("Content-Type", ""), "model")
    except MultipartError as exc:
        raise RequestParseError(f"Invalid request body: {exc}", None) from None
    return CompletionRequest(model=model, prompt="")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One routed endpoint (a row of :data:`ENDPOINTS`).

    Attributes
    ----------
    kind : {"tokenizer", "pooling", "audio", "passthrough"}
        What it is: the request's ``kind`` on the request path and in its record.
    parse : callable
        ``(body, headers) -> CompletionRequest`` with ``model`` (and ``user``) filled.
    audio : bool
        The body is held to ``limits.max_audio_body_bytes`` (else ``max_body_bytes``).
    """

    kind: str
    parse: BodyParser
    audio: bool = False

    def body_limit(self, config: Config) -> tuple[int, str]:
        """The body limit that holds this endpoint's requests: (bytes, config field)."""
        if self.audio:
            return config.limits.max_audio_body_bytes, "limits.max_audio_body_bytes"
        return config.limits.max_body_bytes, "limits.max_body_bytes"


_TOKENIZER = Endpoint("tokenizer", parse_json_model)
_POOLING = Endpoint("pooling", parse_json_model)
_AUDIO = Endpoint("audio", parse_form_model, audio=True)
#: A path of ``proxy.passthrough_paths``.
PASSTHROUGH = Endpoint("passthrough", parse_json_model)

#: The routed engine endpoints by path (``POST``), vLLM 0.32's.
ENDPOINTS: dict[str, Endpoint] = {
    "/tokenize": _TOKENIZER,
    "/detokenize": _TOKENIZER,
    "/pooling": _POOLING,
    "/classify": _POOLING,
    "/score": _POOLING,
    "/v1/score": _POOLING,
    "/rerank": _POOLING,
    "/v1/rerank": _POOLING,
    "/v2/rerank": _POOLING,
    "/v1/audio/transcriptions": _AUDIO,
    "/v1/audio/translations": _AUDIO,
}


def passthrough_allows(paths: tuple[str, ...], path: str) -> bool:
    """``path`` is one of ``paths`` (``proxy.passthrough_paths``) or under one ending in ``/``.

    A path with a ``.`` or ``..`` segment is never allowed (it could leave the prefix on
    the engine's side).
    """
    if any(segment in (".", "..") for segment in path.split("/")):
        return False
    for allowed in paths:
        if path == allowed or (allowed.endswith("/") and path.startswith(allowed)):
            return True
    return False


def endpoint_for(path: str, config: Config) -> Endpoint | None:
    """The endpoint serving ``path``: a row of :data:`ENDPOINTS`, :data:`PASSTHROUGH` for a
    path under ``/v1/`` that ``proxy.passthrough_paths`` allows, else None."""
    endpoint = ENDPOINTS.get(path)
    if endpoint is not None:
        return endpoint
    paths = config.proxy.passthrough_paths
    if paths and path.startswith("/v1/") and passthrough_allows(paths, path):
        return PASSTHROUGH
    return None
