"""Renderers of the decision record's parts that are costly or policy-specific.

``candidates`` and ``filters`` are deferred (:meth:`DecisionRecord.defer`): the
renderers here capture what may change at decision time and build the lists only if
the record is read. :func:`prediction` and :func:`unenforced` are the ``marginal-cost``
policy's part of the record.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from fastroute.policy import Decision
from fastroute.policy.marginal import REASON_SLO_INFEASIBLE, MarginalDecision
from fastroute.proxy.path.engine_load import MIN_SAMPLES_TO_REJECT, EngineLoad

if TYPE_CHECKING:
    from fastroute.proxy.path.fleet import Fleet, FleetState

__all__ = ["Renderer", "choice_renderer", "pd_renderer", "prediction", "unenforced"]

#: A deferred ``(candidates, filters)`` of a decision record.
Renderer = Callable[[], tuple[list[dict[str, Any]], list[dict[str, Any]]]]


def choice_renderer(
    fleet: Fleet, row: int, mask: Any, state: FleetState, decision: Decision
) -> Renderer:
    """The deferred ``(candidates, filters)`` of a decision record.

    Captures what may change later (the state, the ejection reasons) at decision time;
    names, weights and explanations are rendered only if the record is read.
    """
    reasons = fleet.eligibility.ejection_reasons()
    at_cap = fleet.eligibility.cap_reasons()

    def render() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        scores = decision.scores
        candidates = [
            {
                "engine": fleet.names[i],
                "rank": r,
                "weight": float(state.weights[row, i]),
                "score": None if scores is None else scores[r],
            }
            for r, i in enumerate(decision.ranked)
        ]
        return candidates, fleet.eligibility.explain(row, mask, state, reasons, at_cap)

    return render


def pd_renderer(prefill: Renderer, decode: Renderer) -> Renderer:
    """The deferred ``(candidates, filters)`` of a P/D decision, tagged by stage."""

    def render() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        candidates: list[dict[str, Any]] = []
        filters: list[dict[str, Any]] = []
        for stage, renderer in (("prefill", prefill), ("decode", decode)):
            c, f = renderer()
            candidates += [{**x, "stage": stage} for x in c]
            filters += [{**x, "stage": stage} for x in f]
        return candidates, filters

    return render


def prediction(decision: Decision, load: EngineLoad, ranked: Sequence[int]) -> dict[str, Any]:
    """What ``marginal-cost`` predicted, for the decision record: the chosen (or best,
    when rejected) engine's TTFT/TPOT, the output length and cached tokens assumed,
    the marginal cost of each ranked candidate (``candidates[].score`` too), and the
    calibration sample counts of the engine types involved."""
    types = {load.types[i] for i in ranked} or set(load.types)
    calibration = load.calibration
    out: dict[str, Any] = {"cost_s": list(decision.scores or ())}
    if isinstance(decision, MarginalDecision):
        out.update(
            ttft_s=decision.ttft_s,
            tpot_s=decision.tpot_s,
            output_tokens=decision.output_tokens,
            cached_tokens=decision.cached_tokens,
        )
        if decision.detail:
            out["detail"] = decision.detail
    out["calibration_samples"] = {
        t: dict(calibration.model(t).samples_by_kind) for t in sorted(types)
    }
    return out


def unenforced(rejected: Decision) -> str:
    """Why a request the policy found SLO-infeasible was routed anyway."""
    detail = getattr(rejected, "detail", "") or REASON_SLO_INFEASIBLE
    return (
        f"{detail}; routed without the SLO: the calibration has fewer than "
        f"{MIN_SAMPLES_TO_REJECT} samples per engine type and kind"
    )
