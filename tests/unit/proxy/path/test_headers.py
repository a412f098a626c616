"""Header relay: the cached verdicts give the same answer as the work they replace."""

from __future__ import annotations

from types import SimpleNamespace

from multidict import CIMultiDict

from fastroute.proxy.path.headers import HeaderRelay, header_lines


def test_filter_headers_cache_gives_same_answer() -> None:
    """Filter headers cache gives same answer."""
    drop = frozenset({"host", "connection"})
    items = [(b"Host", b"x"), (b"X-Fastroute-Zone", b"us"), (b"X-Request-Id", b"a"), (b"A", b"1")]
    verdicts: dict[bytes, bool] = {}
    for _ in range(2):
        assert header_lines(items, drop, verdicts) == [b"A: 1\r\n"]
    assert verdicts == {b"Host": False, b"X-Fastroute-Zone": False, b"X-Request-Id": False,
                        b"A": True}  # fmt: skip


def test_client_keys_reach_engines_only_when_forwarded() -> None:
    """The client's ``Authorization`` and Anthropic's ``x-api-key`` are its tenant key: sent
    to engines only with ``forward_authorization`` (else the engine's own key)."""
    raw = [(b"x-api-key", b"sk-client"), (b"anthropic-version", b"2023-06-01")]
    request = SimpleNamespace(headers=CIMultiDict({k.decode(): v.decode() for k, v in raw}),
                              raw_headers=raw)  # fmt: skip
    kept = HeaderRelay(False).to_engine(request, "sk-engine", "r1")
    assert b"sk-client" not in kept and b"Authorization: Bearer sk-engine\r\n" in kept
    assert b"anthropic-version: 2023-06-01\r\n" in kept
    forwarded = HeaderRelay(True).to_engine(request, "sk-engine", "r1")
    assert b"x-api-key: sk-client\r\n" in forwarded and b"sk-engine" not in forwarded
