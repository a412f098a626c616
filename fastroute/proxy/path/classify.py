"""The request path's first steps: body limit, minimal parse, tenant, class, SLO headers.

Each step either fills the request's :class:`~fastroute.proxy.path.request_state.RequestState`
or raises :class:`Reject` with the client's response (413, 400, 401, 403, 404). Also
the leading prompt text handed to prefix-aware policies (:func:`route_prefix`).
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from fastroute.config import PRIORITIES, ClassConfig, Config, TenantConfig, hash_api_key
from fastroute.proxy.http.openai_errors import error_reply
from fastroute.proxy.http.reply import Reply
from fastroute.proxy.path.api_requests import parse_messages, parse_responses
from fastroute.proxy.path.request_state import RequestState
from fastroute.proxy.path.requests import (
    ChatRequest,
    CompletionRequest,
    ParsedRequest,
    RequestParseError,
    parse_chat,
    parse_completion,
    too_deep_error,
)
from fastroute.proxy.path.slo import request_slos

__all__ = [
    "PREFIX_BYTES",
    "Classifier",
    "Reject",
    "key_depth_bytes",
    "parse_embeddings",
    "route_prefix",
]

#: Bytes of prompt text handed to prefix-aware policies (``RouteRequest.prefix``) unless
#: the policy asks for another length (``Policy.prefix_bytes``).
PREFIX_BYTES = 4096

#: Most distinct zone sets whose sorted list is cached for decision records.
MAX_CACHED_ZONE_SETS = 1024

#: Parsers of the kinds routed like chat from another API's body (``api_requests``).
_CHAT_LIKE_PARSERS = {
    "responses": parse_responses,
    "messages": parse_messages,
    "count_tokens": parse_messages,
}
#: Anthropic's API-key header, read as the tenant's key when there is no bearer token.
ANTHROPIC_KEY_HEADER = "x-api-key"


class Reject(Exception):
    """A request refused before routing; carries the response."""

    def __init__(self, response: Reply) -> None:
        super().__init__(response.status)
        self.response = response

    @property
    def reason(self) -> str:
        """Why, for the decision record: the error message the client got."""
        try:
            message = msgspec.json.decode(self.response.body)["error"]["message"]
        except (msgspec.DecodeError, KeyError, TypeError):
            message = None
        return f"rejected before routing (HTTP {self.response.status}): {message}"


class _EmbeddingRequest(msgspec.Struct):
    """The fields of ``POST /v1/embeddings`` routing reads."""

    model: str | None = None
    user: str | None = None


_embedding_decoder = msgspec.json.Decoder(_EmbeddingRequest)


def parse_embeddings(body: bytes) -> CompletionRequest:
    """The routing fields of an embeddings body, as a prompt-less completion request."""
    try:
        req = _embedding_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise RequestParseError(f"Invalid request body: {exc}", None) from None
    except RecursionError:
        raise too_deep_error() from None
    # An empty prompt makes routing_key fall through to user, then the request id:
    # embeddings have no KV cache to be sticky to.
    return CompletionRequest(model=req.model, user=req.user, prompt="")


def route_prefix(parsed: ParsedRequest, limit_bytes: int = PREFIX_BYTES) -> bytes:
    """Leading prompt text for prefix-aware policies, at most ``limit_bytes`` bytes."""
    if isinstance(parsed, ChatRequest):
        parts: list[str] = []
        size = 0
        for message in parsed.messages:
            content = message.content
            text = (
                content
                if isinstance(content, str)
                else " ".join(p.text or "" for p in content or [] if p.type == "text")
            )
            parts.append(text)
            size += len(text)
            if size >= limit_bytes:
                break
        return "\n".join(parts).encode()[:limit_bytes]
    prompt = parsed.prompt
    if isinstance(prompt, str):
        return prompt[:limit_bytes].encode()[:limit_bytes]
    if prompt and isinstance(prompt[0], str):
        return prompt[0][:limit_bytes].encode()[:limit_bytes]
    return b""


def key_depth_bytes(parsed: ParsedRequest, source: str) -> int:
    """Where the routing key ends in :func:`route_prefix`'s bytes (``key_depth_bytes``).

    0 for a key the client declared (session header, ``prompt_cache_key``); for the
    conversation key, the bytes of the joined messages through the first user message;
    -1 for every other source (``user`` names a person, not a prompt; the completion
    prompt key is itself a prefix depth; request ids are random).
    """
    if source in ("header", "prompt_cache_key"):
        return 0
    if source != "conversation" or not isinstance(parsed, ChatRequest):
        return -1
    size = -1
    for message in parsed.messages:
        content = message.content
        text = (
            content
            if isinstance(content, str)
            else " ".join(p.text or "" for p in content or [] if p.type == "text")
        )
        size += 1 + len(text.encode())
        if message.role == "user":
            return size
    return -1


class Classifier:
    """Parse and classify requests against one config.

    Parameters
    ----------
    config : Config
    rows : dict of (model, priority) to int
        The main fleet's class rows.
    """

    def __init__(self, config: Config, rows: Mapping[tuple[str, str], int]) -> None:
        self.config = config
        self._rows = rows
        self._tenant_by_hash: dict[str, TenantConfig] = {}
        for tenant in config.tenants:
            for key in tenant.api_keys:
                self._tenant_by_hash[hash_api_key(key)] = tenant
            for digest in tenant.api_key_sha256:
                self._tenant_by_hash[digest] = tenant
        self._default_tenant = next(
            (t for t in config.tenants if t.name == config.proxy.default_tenant), None
        )
        self._all_zones = frozenset(r.zone for r in config.network.regions) | frozenset(
            e.zone for e in config.engines if e.zone
        )
        self._models = frozenset(config.models())
        self._sorted_zones: dict[frozenset[str], list[str]] = {}

    def too_large(self) -> Reject:
        """413 for a body over ``limits.max_body_bytes``."""
        limit = self.config.limits.max_body_bytes
        return Reject(
            error_reply(
                413,
                f"Request body is larger than the limit of {limit} bytes.",
                code="request_too_large",
            )
        )

    def parse(self, kind: str, body: bytes) -> ParsedRequest:
        """The minimal parse of ``body`` (400 if malformed or without a model)."""
        try:
            if kind == "chat":
                parsed: ParsedRequest = parse_chat(body)
            elif kind == "completions":
                parsed = parse_completion(body)
            elif kind in _CHAT_LIKE_PARSERS:
                parsed = _CHAT_LIKE_PARSERS[kind](body)
            else:
                parsed = parse_embeddings(body)
        except RequestParseError as exc:
            err = exc.to_openai_error()["error"]
            raise Reject(
                error_reply(400, str(err["message"]), param=err["param"], code=None)
            ) from None
        if not parsed.model:
            raise Reject(
                error_reply(
                    400,
                    "You must provide a model parameter.",
                    param="model",
                    code="missing_model",
                )
            )
        return parsed

    def tenant(self, headers: Mapping[str, str]) -> TenantConfig | None:
        """The tenant of the request's API key (401 if none and no default tenant).

        The key is the ``Authorization`` bearer token, else Anthropic's ``x-api-key``.
        """
        if not self.config.tenants:
            return None
        auth = headers.get("Authorization", "")
        tenant = None
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if not key:
            key = headers.get(ANTHROPIC_KEY_HEADER, "").strip()
        if key:
            tenant = self._tenant_by_hash.get(hash_api_key(key))
        if tenant is None:
            tenant = self._default_tenant
        if tenant is None:
            raise Reject(error_reply(401, "Invalid or missing API key.", code="invalid_api_key"))
        return tenant

    def classify(self, state: RequestState) -> ClassConfig:
        """Fill the classification of ``state`` (tenant, zones, priority, class, row);
        returns the class."""
        proxy = self.config.proxy
        headers = state.request.headers
        tenant = self.tenant(headers)
        zones = frozenset(tenant.zones) if tenant and tenant.zones else self._all_zones
        narrow = headers.get(proxy.zone_header)
        if narrow is not None:
            asked = frozenset(z.strip() for z in narrow.split(",") if z.strip())
            zones = zones & asked
            if not zones:
                raise Reject(
                    error_reply(
                        403,
                        f"Header {proxy.zone_header} names no residency zone this tenant "
                        f"may use (asked {sorted(asked)}).",
                        code="zone_not_allowed",
                    )
                )
        priority = headers.get(proxy.priority_header)
        if priority is None:
            priority = tenant.default_priority if tenant else "default"
        elif priority not in PRIORITIES:
            raise Reject(
                error_reply(
                    400,
                    f"Header {proxy.priority_header} must be one of {', '.join(PRIORITIES)}; "
                    f"got {priority!r}.",
                    code="invalid_priority",
                )
            )
        assert state.parsed is not None
        model = str(state.parsed.model)
        if model not in self._models:
            raise Reject(
                error_reply(
                    404,
                    f"The model `{model}` does not exist or is not served by this proxy.",
                    param="model",
                    code="model_not_found",
                )
            )
        state.model, state.priority = model, priority
        state.tenant = tenant.name if tenant else ""
        state.zones = zones
        state.hardware = tenant.hardware if tenant else None
        cls = state.cls = self.config.class_for(model, priority)
        state.row = self._rows[(model, priority)]
        return cls

    def slos(self, state: RequestState) -> None:
        """Fill the request's SLOs from its headers or the class defaults (400 if bad)."""
        cls = state.cls
        assert cls is not None
        try:
            state.slo_ttft_s, state.slo_tpot_s = request_slos(
                state.request.headers, cls.ttft_slo_s, cls.tbot_slo_s
            )
        except ValueError as exc:
            raise Reject(error_reply(400, str(exc), code="invalid_slo")) from None

    def zone_list(self, zones: frozenset[str]) -> list[str]:
        """``sorted(zones)`` for the record, cached (a handful of distinct sets)."""
        out = self._sorted_zones.get(zones)
        if out is None:
            if len(self._sorted_zones) >= MAX_CACHED_ZONE_SETS:
                self._sorted_zones.clear()
            out = self._sorted_zones[zones] = sorted(zones)
        return list(out)
