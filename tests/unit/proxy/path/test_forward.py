"""The ranked-attempt loop in isolation: retries on the next engine within the budget."""

from __future__ import annotations

import asyncio

import msgspec

from fastroute.config import decode_config
from fastroute.guards.outlier import Outcome
from fastroute.policy import Decision
from fastroute.proxy.http.reply import Reply
from fastroute.proxy.http.upstream import UpstreamError
from fastroute.proxy.path.decisions import Attempt, DecisionRecord
from fastroute.proxy.path.forward import Forwarder
from fastroute.proxy.path.headers import HeaderRelay
from fastroute.proxy.path.outcomes import Retryable
from fastroute.proxy.path.request_state import RequestState
from fastroute.proxy.proxy_app import build_context

_CONFIG = "".join(
    f'[[engines]]\nname = "e{i}"\nurl = "http://127.0.0.1:{9000 + i}"\nmodels = ["m"]\n\n'
    for i in range(3)
)


def _run(fails: int, retry: str = "") -> tuple[Reply, list[int], DecisionRecord]:
    """try_ranked over engines (0, 1, 2) whose first ``fails`` attempts time out."""
    ctx = build_context(decode_config(_CONFIG + retry), None, None)
    forwarder = Forwarder(ctx, HeaderRelay(False))
    tried: list[int] = []
    record = DecisionRecord(request_id="r1", endpoint="/v1/completions")

    async def attempt(state: RequestState, rank: int, index: int) -> Reply:
        tried.append(index)
        record.attempts.append(Attempt(engine=f"e{index}", rank=rank))
        if len(tried) <= fails:
            raise Retryable(UpstreamError(Outcome.TIMEOUT, f"engine e{index} timed out"))
        return Reply(200, [], b"ok")

    forwarder.attempt = attempt  # type: ignore[method-assign]
    forwarder.deposit(ctx.fleet.state)
    state = RequestState(None, "completions", b"{}", None, record, None, 0.0)  # type: ignore[arg-type]
    decision = Decision(ranked=(0, 1, 2), engine_ids=(0, 0, 0), policy="p", reason="r")
    return asyncio.run(forwarder.try_ranked(state, decision)), tried, record


def test_the_first_answer_wins_and_a_failure_moves_to_the_next_ranked_engine() -> None:
    reply, tried, _ = _run(fails=0)
    assert reply.body == b"ok" and tried == [0]
    reply, tried, _ = _run(fails=1)
    assert reply.body == b"ok" and tried == [0, 1]


def test_past_max_retries_the_last_failure_is_the_answer_with_the_decision() -> None:
    reply, tried, record = _run(fails=3, retry="[retry]\nmax_retries = 1\n")
    assert tried == [0, 1] and reply.status == 504
    assert msgspec.json.decode(reply.body)["error"]["code"] == "upstream_timeout"
    assert dict(reply.headers)["x-fastroute-engine"] == "e1"
    assert record.error is None  # not refused by the budget: max_retries reached
