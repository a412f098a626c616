"""SolveMemo: a period whose LP inputs equal the last solve's reuses its result, nothing else.

The service tests drive :class:`ControllerService` in-process with :meth:`step` and a fake clock
(no loop, no scrapes); its table is a real shared-memory segment and the LP is real HiGHS.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import numpy as np
import pytest

import controller.planner as planner_module
from controller.memo import SolveInputs, SolveMemo
from controller.options import ControllerOptions
from controller.planner import LPPlanner
from controller.service import ControllerService
from controller.solve import SolveError
from fastroute.config import Config, decode_config
from fastroute.hashing import class_key
from fastroute.signals.reports import ClassDemand, Report

MODEL = "demo-8b"


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30.0))


def config(table: str) -> Config:
    engines = "".join(
        f'[[engines]]\nname = "engine-{i}"\nurl = "http://127.0.0.1:{9 + i}"\n'
        f'models = ["{MODEL}"]\nregion = "east"\nhardware = "{hw}"\ncapacity_rps = {cap}\n\n'
        for i, (hw, cap) in enumerate((("h100", 10.0), ("a40", 4.0), ("a40", 4.0)))
    )
    return decode_config(
        engines
        + '[[network.regions]]\nname = "east"\n\n'
        + "[controller]\nperiod_s = 1.0\nsolve_time_limit_s = 0.5\n\n"
        + f'[proxy]\ncluster = "east"\ntable_name = "{table}"\n',
        source="test.toml",
    )


class Clock:
    def __init__(self) -> None:
        self.now_s = 1_000_000.0

    def __call__(self) -> float:
        return self.now_s


def report(requests: int, now_s: float) -> Report:
    classes = [ClassDemand(class_key=class_key("east", MODEL, "default"), requests=requests)]
    return Report(1, "east", "w-1", now_s - 1.0, now_s, classes, [])


class CountingSolve:
    """Wraps the service's period solve and counts the calls."""

    def __init__(self) -> None:
        self.calls = 0
        self._solve = planner_module._solve_period

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        return self._solve(*args)


def memo(svc: ControllerService) -> SolveMemo[Any]:
    assert isinstance(svc.planner, LPPlanner)
    return svc.planner.memo


# -- SolveInputs / SolveMemo ---------------------------------------------------------------------


def test_inputs_compare_lp_and_model_by_identity_and_arrays_bitwise() -> None:
    """Equal-looking but distinct objects, or a one-ulp demand change, are different inputs."""
    lp, model = object(), object()
    demand, anchor = np.array([1.0, 2.0]), np.array([[0.5, 0.5]])
    base = SolveInputs(lp, model, demand, anchor, 0.4, 2.0)
    assert base.same_as(SolveInputs(lp, model, demand.copy(), anchor.copy(), 0.4, 2.0))
    assert not base.same_as(SolveInputs(object(), model, demand, anchor, 0.4, 2.0))
    assert not base.same_as(SolveInputs(lp, object(), demand, anchor, 0.4, 2.0))
    bumped = demand.copy()
    bumped[1] = np.nextafter(bumped[1], 3.0)
    assert not base.same_as(SolveInputs(lp, model, bumped, anchor, 0.4, 2.0))
    assert not base.same_as(SolveInputs(lp, model, demand, None, 0.4, 2.0))
    assert not base.same_as(SolveInputs(lp, model, demand, anchor.reshape(2, 1), 0.4, 2.0))
    assert not base.same_as(SolveInputs(lp, model, demand, anchor, 0.5, 2.0))
    assert not base.same_as(SolveInputs(lp, model, demand, anchor, 0.4, 3.0))
    assert SolveInputs(lp, model, demand, None, 0.4, 2.0).same_as(
        SolveInputs(lp, model, demand, None, 0.4, 2.0)
    )


def test_inputs_copy_the_arrays() -> None:
    """Changing the caller's array in place later does not change the remembered input."""
    lp, model = object(), object()
    demand = np.array([1.0, 2.0])
    kept = SolveInputs(lp, model, demand, None, 0.4, 2.0)
    demand[0] = 5.0
    assert not kept.same_as(SolveInputs(lp, model, demand, None, 0.4, 2.0))


def test_memo_answers_only_the_stored_inputs_until_forgotten() -> None:
    """get returns the stored result for the same inputs (counted), None otherwise or after
    forget."""
    lp, model = object(), object()
    memo: SolveMemo[str] = SolveMemo()
    one = SolveInputs(lp, model, np.array([1.0]), None, 0.4, 2.0)
    assert memo.get(one) is None
    memo.put(one, "result")
    assert memo.get(SolveInputs(lp, model, np.array([1.0]), None, 0.4, 2.0)) == "result"
    assert memo.get(SolveInputs(lp, model, np.array([2.0]), None, 0.4, 2.0)) is None
    assert memo.reused_total == 1
    memo.forget()
    assert memo.get(one) is None and memo.reused_total == 1


# -- in the service ------------------------------------------------------------------------------


def test_unchanged_inputs_do_not_solve_and_changed_ones_do(
    shm_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At steady demand the LP runs until its fixed point, then not again; the heartbeat still
    republishes; a demand step solves again; the counters say which happened."""
    solve = CountingSolve()
    monkeypatch.setattr(planner_module, "_solve_period", solve)
    clock = Clock()

    async def main() -> None:
        svc = ControllerService(
            config(shm_name), ControllerOptions(republish_after_s=5.0), clock=clock
        )
        svc.open()
        try:
            for _ in range(4):  # default demand: solves until x stops moving
                clock.now_s += 1.0
                await svc.step()
            settled = solve.calls
            assert 1 <= settled < 4
            gen = svc.generation
            for _ in range(3):
                clock.now_s += 1.0
                await svc.step()
            assert solve.calls == settled
            assert memo(svc).reused_total >= 3
            registry = svc.metrics.registry
            reused = registry.get_sample_value("fastroute_controller_solves_reused_total")
            assert reused == memo(svc).reused_total
            # every period still counts as a solve by status (the "not planning" alert's rate)
            optimal = {"status": "Optimal"}
            solves = registry.get_sample_value("fastroute_controller_solves_total", optimal)
            assert solves == svc.periods_total
            timed = registry.get_sample_value("fastroute_controller_solve_seconds_count")
            assert timed == settled
            assert svc.plan is not None and svc.plan.plan_id == svc.periods_total
            for _ in range(4):  # past republish_after_s: a heartbeat generation, still no solve
                clock.now_s += 1.0
                await svc.step()
            assert solve.calls == settled and svc.generation > gen
            clock.now_s += 1.0
            svc.observe(report(30, clock.now_s))  # measured demand replaces the default
            await svc.step()
            assert solve.calls == settled + 1
        finally:
            svc.close()

    run(main())


def test_a_failed_solve_forgets_the_memo(shm_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a SolveError the next period solves even though its inputs are the last good ones."""
    solve = CountingSolve()
    monkeypatch.setattr(planner_module, "_solve_period", solve)
    clock = Clock()

    async def main() -> None:
        svc = ControllerService(config(shm_name), clock=clock)
        svc.open()
        try:
            for _ in range(4):
                clock.now_s += 1.0
                await svc.step()
            calls = solve.calls
            clock.now_s += 1.0
            await svc.step()
            assert solve.calls == calls  # reused

            def fail(*args: Any) -> Any:
                solve.calls += 1
                raise SolveError("Infeasible", "injected")

            monkeypatch.setattr(planner_module, "_solve_period", fail)
            memo(svc).forget()  # make this period reach the (failing) solver
            clock.now_s += 1.0
            assert not await svc.step() and svc.last_error is not None
            monkeypatch.setattr(planner_module, "_solve_period", solve)
            calls = solve.calls
            clock.now_s += 1.0
            await svc.step()
            assert solve.calls == calls + 1 and svc.last_error is None
        finally:
            svc.close()

    run(main())


def test_a_reused_result_is_what_solving_again_gives(
    shm_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each time the memo answers, solving the same inputs on the same LP instead returns
    bitwise the same result, weights, shed fractions and allocation."""
    clock = Clock()
    checked = []
    original_get = SolveMemo.get

    def get_and_check(self: SolveMemo[Any], inputs: SolveInputs) -> Any:
        kept = original_get(self, inputs)
        if kept is not None:
            again = planner_module._solve_period(
                inputs.lp, inputs.model, inputs.demand_rps, inputs.anchor_rps,
                inputs.kappa_s, inputs.shed_base_factor,
            )  # fmt: skip
            assert again[0].x_rps.tobytes() == kept[0].x_rps.tobytes()
            assert again[0].shed_rps.tobytes() == kept[0].shed_rps.tobytes()
            for mine, theirs in zip(again[1:], kept[1:], strict=True):
                assert mine.tobytes() == theirs.tobytes()
            checked.append(True)
        return kept

    monkeypatch.setattr(SolveMemo, "get", get_and_check)

    async def main() -> None:
        svc = ControllerService(
            config(shm_name), ControllerOptions(republish_after_s=4.0), clock=clock
        )
        svc.open()
        rng = np.random.default_rng(3)
        try:
            for k in range(40):
                clock.now_s += 1.0
                rate = 6 if k < 15 else (14 if k < 30 else 3)
                svc.observe(report(int(rng.poisson(rate)), clock.now_s))
                await svc.step()
        finally:
            svc.close()

    run(main())
    assert len(checked) > 10
