"""Header relay: the cached verdicts give the same answer as the work they replace."""

from __future__ import annotations

from fastroute.proxy.path.headers import header_lines


def test_filter_headers_cache_gives_same_answer() -> None:
    """Filter headers cache gives same answer."""
    drop = frozenset({"host", "connection"})
    items = [(b"Host", b"x"), (b"X-Fastroute-Zone", b"us"), (b"X-Request-Id", b"a"), (b"A", b"1")]
    verdicts: dict[bytes, bool] = {}
    for _ in range(2):
        assert header_lines(items, drop, verdicts) == [b"A: 1\r\n"]
    assert verdicts == {b"Host": False, b"X-Fastroute-Zone": False, b"X-Request-Id": False,
                        b"A": True}  # fmt: skip
