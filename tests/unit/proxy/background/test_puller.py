"""The puller's catch-up after a failover: which controller next, and how long to wait."""

from __future__ import annotations

import aiohttp
import pytest

from fastroute.proxy.background.leader_lookup import EtcdLeader
from fastroute.proxy.background.puller import (
    FAILOVER_BACKOFF_MAX_S,
    PullError,
    WeightsPuller,
    _leader_table_url,
)

URLS = ("http://a:1", "http://b:2", "http://c:3")


def _puller(n_urls: int = 3, **kw: object) -> WeightsPuller:
    kw = {"backoff_initial_s": 0.25, "backoff_max_s": 15.0, "rng": lambda: 1.0, **kw}
    return WeightsPuller(URLS[0], "unused", fallback_urls=URLS[1:n_urls], **kw)  # type: ignore[arg-type]


def _fail(puller: WeightsPuller, exc: BaseException) -> float:
    return puller._wait_s(puller._record_error(exc))


def test_one_round_of_immediate_retries_then_exponential_while_nothing_answers() -> None:
    puller = _puller()
    seen = []
    waits = []
    for _ in range(6):
        seen.append(puller.url)
        waits.append(_fail(puller, aiohttp.ClientConnectionError("refused")))
    assert waits[:3] == [0.0, 0.0, 0.0]  # the other controllers are asked at once
    assert waits[3:] == [2.0, 4.0, 8.0]  # then the old backoff: nothing answers at all
    assert seen == [u + "/v1/table" for u in URLS + URLS]  # in turn, round after round


def test_a_controller_that_answers_without_a_leader_keeps_the_wait_short() -> None:
    puller = _puller()
    waits = [_fail(puller, PullError("http", "503", alive=True)) for _ in range(8)]
    assert waits[:3] == [0.0, 0.0, 0.0]
    assert all(0 < w <= FAILOVER_BACKOFF_MAX_S for w in waits[3:])


def test_a_lone_controller_backs_off_as_before() -> None:
    puller = _puller(n_urls=1)
    assert [_fail(puller, PullError("http", "503", alive=True)) for _ in range(2)] == [0.25, 0.5]
    puller = _puller(n_urls=1)
    assert [_fail(puller, PullError("http", "500")) for _ in range(3)] == [0.25, 0.5, 1.0]


def test_errors_that_are_not_the_controllers_absence_back_off() -> None:
    puller = _puller()
    assert _fail(puller, PullError("too_large", "big")) == 0.25
    assert puller.url == puller.urls[0]  # no reason to ask another controller


def test_etcd_counts_in_the_round_and_rotation_skips_to_the_next_url() -> None:
    leader = EtcdLeader(("http://127.0.0.1:9",), "/k", 0.1)
    puller = _puller(leader=leader)
    assert puller.round_size() == 4
    puller.url = "http://leader:9/v1/table"  # reached by a redirect, then it died
    _fail(puller, PullError("http", "503", alive=True))
    assert puller.url == URLS[1] + "/v1/table" and puller._ask_leader


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"x-fastroute-leader": "http://l:7/", "Location": "x"}, "http://l:7/v1/table"),
        ({"Location": "http://l:7/v1/table?after=3&epoch=4"}, "http://l:7/v1/table"),
    ],
)
def test_a_redirect_names_the_leaders_table(headers: dict[str, str], expected: str) -> None:
    assert _leader_table_url(headers, "http://f:1/v1/table") == expected


def test_a_relative_redirect_resolves_and_another_scheme_is_an_error() -> None:
    assert _leader_table_url({"Location": "/v1/table?a=1"}, "http://f:1/v1/table") == (
        "http://f:1/v1/table"
    )
    with pytest.raises(PullError):
        _leader_table_url({"Location": "ftp://x/v1/table"}, "http://f:1/v1/table")
