"""The request path's tenant limiter: static split, the controller's shares, fair shedding."""

from __future__ import annotations

import pytest

from fastroute.config import decode_config
from fastroute.proxy.http.reply import Reply
from fastroute.proxy.metrics import ProxyMetrics
from fastroute.proxy.path.tenant_limits import TenantAdmission, TenantLimiter
from fastroute.tables.tenant_limits import TenantLimitBlock

CONFIG = """
[[engines]]
name = "e0"
url = "http://127.0.0.1:9"
models = ["m"]

[proxy]
proxy_count = 2

[[tenants]]
name = "a"
api_keys = ["ka"]
requests_per_min = 8
max_concurrent = 3

[[tenants]]
name = "b"
api_keys = ["kb"]
"""


@pytest.fixture
def limiter() -> TenantLimiter:
    config = decode_config(CONFIG, source="t.toml")
    block = TenantLimitBlock.private(2)
    yield TenantLimiter(config, block, "me:1", ProxyMetrics(lambda: None))
    block.close()


def _admit_all(limiter: TenantLimiter, tenant: str, n: int) -> list[object]:
    return [limiter.admit(tenant, 10) for _ in range(n)]


def test_without_a_controller_each_proxy_takes_its_static_split(limiter: TenantLimiter) -> None:
    got = _admit_all(limiter, "a", 2)
    assert all(isinstance(g, TenantAdmission) for g in got)
    refused = limiter.admit("a", 10)  # max_concurrent 3 over 2 proxies: ceil(1.5) = 2 each
    assert isinstance(refused, Reply) and refused.status == 429
    assert limiter.admit("b", 10) is None  # no limits: nothing counted
    headers = dict(refused.headers)
    assert headers["x-ratelimit-limit-requests"] == "4"  # 8 / proxy_count 2
    assert headers["x-ratelimit-remaining-requests"] == "2"
    assert "Retry-After" in headers
    assert b"concurrent requests" in refused.body


def test_the_controller_share_replaces_the_static_split(limiter: TenantLimiter) -> None:
    limiter.follow(7, {"tenant_limits": {"me:1": {"a": [2.0, None, 100]}, "other:1": {}}})
    got = _admit_all(limiter, "a", 3)
    assert [isinstance(g, TenantAdmission) for g in got] == [True, True, False]
    assert b"requests per minute" in got[2].body
    for g in got[:2]:
        limiter.finish(g, used_tokens=None)
    limiter.follow(8, {})  # the controller stopped publishing shares: back to the split
    assert isinstance(limiter.admit("a", 10), TenantAdmission)


def test_the_tenant_shed_fraction_overrides_the_class_one(limiter: TenantLimiter) -> None:
    limiter.follow(3, {"tenant_shed": {"a": 0.25}})
    assert limiter.shed_fraction("a", 0.5) == 0.25
    assert limiter.shed_fraction("b", 0.5) == 0.5


def test_finish_releases_the_concurrency(limiter: TenantLimiter) -> None:
    got = _admit_all(limiter, "a", 2)
    assert isinstance(limiter.admit("a", 1), Reply)
    limiter.finish(got[0], used_tokens=3)
    assert isinstance(limiter.admit("a", 1), TenantAdmission)
