"""Which headers cross the proxy, both ways, and the proxy's own response headers.

Headers are relayed as the parsers gave them (raw name/value bytes), minus hop-by-hop
names, the proxy's own ``x-fastroute-*``/``x-request-id`` and a few the proxy sets
itself. Verdicts are cached per raw name: clients and engines send the same few header
names over and over.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from fastroute.proxy.http.http1 import Response
from fastroute.proxy.http.upstream import HOP_BY_HOP
from fastroute.proxy.path.decisions import DecisionRecord

if TYPE_CHECKING:
    from fastroute.proxy.path.handler import Incoming

__all__ = ["MAX_CACHED_HEADER_NAMES", "HeaderRelay", "decision_headers", "header_lines"]

# x-api-key: Anthropic's form of the client's key, kept from engines like Authorization.
_DROP_REQUEST_HEADERS = HOP_BY_HOP | {
    "host",
    "content-length",
    "authorization",
    "x-api-key",
    "accept-encoding",
}
_DROP_RESPONSE_HEADERS = HOP_BY_HOP | {
    "content-length",
    "content-encoding",
    "server",
    "date",
}

#: Most header names whose forward/drop verdict is cached (per handler, per direction).
MAX_CACHED_HEADER_NAMES = 1024


def _forwardable(low: str, drop: frozenset[str]) -> bool:
    """Whether a header (lowercase name) passes a drop set and the proxy's own names."""
    return not (low in drop or low.startswith("x-fastroute-") or low == "x-request-id")


def header_lines(
    raw: Iterable[tuple[bytes, bytes]], drop: frozenset[str], verdicts: dict[bytes, bool]
) -> list[bytes]:
    """The encoded ``name: value\\r\\n`` lines of the raw pairs that pass ``drop``.

    Headers are relayed as the parser gave them (no CR/LF inside), never decoded.
    ``verdicts`` caches the decision per raw name: clients and engines send the same
    few header names over and over.
    """
    lines = []
    for name, value in raw:
        keep = verdicts.get(name)
        if keep is None:
            keep = _forwardable(name.decode("latin-1").lower(), drop)
            if len(verdicts) >= MAX_CACHED_HEADER_NAMES:
                verdicts.clear()
            verdicts[name] = keep
        if keep:
            lines.append(b"%b: %b\r\n" % (name, value))
    return lines


def decision_headers(record: DecisionRecord) -> dict[str, str]:
    """The proxy's headers on an error response: the engine that answered, the decision."""
    engine = record.attempts[-1].engine if record.attempts else "none"
    return {
        "x-fastroute-engine": engine,
        "x-fastroute-decision": record.header(),
    }


class HeaderRelay:
    """The header lines sent to engines and relayed to clients, with cached verdicts.

    Parameters
    ----------
    forward_authorization : bool
        Relay the client's ``Authorization`` to engines (``proxy.forward_authorization``).
    """

    def __init__(self, forward_authorization: bool) -> None:
        self.forward_authorization = forward_authorization
        self._request_verdicts: dict[bytes, bool] = {}
        self._response_verdicts: dict[bytes, bool] = {}
        self._auth_lines: dict[str, bytes] = {}  # one per configured engine key

    def to_engine(self, request: Incoming, engine_key: str | None, rid: str) -> bytes:
        """The header lines to send to the engine, encoded (``http1`` takes them as is).

        Relayed as received, minus the drop set (:func:`header_lines`).
        """
        headers = request.headers
        raw = request.raw_headers
        connection = headers.get("Connection")
        if connection:  # names listed in Connection are hop-by-hop too: no cached verdicts
            drop = _DROP_REQUEST_HEADERS | {t.strip().lower() for t in connection.split(",")}
            lines = header_lines(raw, drop, {})
        else:
            lines = header_lines(raw, _DROP_REQUEST_HEADERS, self._request_verdicts)
        if self.forward_authorization and "Authorization" in headers:
            auth = headers["Authorization"].encode("utf-8", "surrogateescape")
            lines.append(b"Authorization: %b\r\n" % auth)
        elif self.forward_authorization and "x-api-key" in headers:
            key = headers["x-api-key"].encode("utf-8", "surrogateescape")
            lines.append(b"x-api-key: %b\r\n" % key)
        elif engine_key:
            lines.append(self._engine_auth(engine_key))
        lines.append(f"x-request-id: {rid}\r\n".encode())
        return b"".join(lines)

    def _engine_auth(self, key: str) -> bytes:
        """``Authorization: Bearer <key>`` for an engine's configured key, encoded once."""
        line = self._auth_lines.get(key)
        if line is None:
            if "\r" in key or "\n" in key:
                raise ValueError("an engine api_key contains CR or LF")
            line = self._auth_lines[key] = f"Authorization: Bearer {key}\r\n".encode()
        return line

    def to_client(self, resp: Response, record: DecisionRecord) -> bytes:
        """The engine's headers to relay plus the proxy's, as encoded lines.

        Relayed as received, minus the drop set (:func:`header_lines`).
        """
        lines = header_lines(resp.raw_headers, _DROP_RESPONSE_HEADERS, self._response_verdicts)
        engine = record.attempts[-1].engine if record.attempts else "none"
        lines.append(
            f"x-fastroute-engine: {engine}\r\nx-fastroute-decision: {record.header()}\r\n".encode(
                "utf-8", "surrogateescape"
            )
        )
        return b"".join(lines)
