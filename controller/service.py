"""The control loop: demand → LP → weights → shared-memory table (+ HTTP snapshot).

Every ``controller.period_s`` :meth:`ControllerService.step` does, in order:

1. **Demand**: :class:`controller.demand.DemandForecaster` closes the period (EWMA + recent peak of
   the proxies' reported requests/s per class, held within a dead band of 2 Poisson standard
   errors so the LP does not re-split traffic on sampling noise). A class never measured gets the
   default: each engine's capacity split equally over the classes eligible on it, times
   ``default_fraction`` (0.5), so the defaults of all classes together ask for half the fleet.
   Floor: ``floor_fraction`` (1e-3) of the class's eligible capacity, so no row empties while
   engines exist.
2. **LP data** (static, built once from the config, :class:`controller.model.FleetModel`):
   classes are (source cluster, model, priority) for every declared region, served model and
   priority, keyed
   by :func:`class_key` (the proxy's row key), for every model some ``both`` engine serves (a P/D
   model has no rows: the proxy weighs its pools by capacity and the controller never sheds
   it). Eligibility: the engine serves the model and has role ``both``; every zone is eligible
   (the proxy filters zones per request). Network latency: the config RTT from the class's
   cluster to the engine's region (one round trip per request).
   Profiles: seeded with :meth:`LatencyProfile.seed` and the per-hardware constants of
   :data:`controller.model.HARDWARE_SEED_LATENCY_S` on the config's breakpoint grid, then fitted
   online per *fit group* (hardware, models, region, role) by
   :class:`controller.profiles.ProfileFitter` from
   every window's signals; a refit replaces a group's profile only past ``profile_deadband``
   (:class:`controller.learning.FleetLearning`).
   Health from the derating state (see below). Engines are grouped
   (:func:`controller.groups.group_engines`, exact aggregation) again whenever health or a
   profile changes.
3. **Solve** (:class:`controller.planner.LPPlanner`; ``mode = "p-controller"``:
   :class:`controller.planner.PControllerPlanner`) :class:`controller.solve.RoutingLP` (warm; the
   anchor ``x⁰`` is what the published table sends at the new forecast,
   :func:`controller.weights.table_anchor`) in a worker thread (``asyncio.to_thread``), HiGHS
   time limit
   ``controller.solve_time_limit_s``. Shed penalty base ``P₀ = shed_base_factor · (max m + max d +
   2 max κ)`` (never cheaper to shed than to serve anything servable), ``π`` per priority from
   ``controller.shed_penalties``. A period whose LP inputs equal the last successful solve's
   reuses its result (:class:`controller.memo.SolveMemo`): no hand-off, no HiGHS run.
4. **Weights**: :func:`class_weights` (fallback: eligible capacity for classes without
   allocation), :func:`engine_weights` (split ∝ capacity), :func:`validate_weights`. Shed
   fractions from :func:`shed_at_demand` at the demand *level* (the EWMA; the LP planned for the
   held forecast).
5. **Publish** (:class:`controller.publish.TablePublisher`), only when weights, shed fractions
   or the retry ratio changed, to the local table
   ``TableWriter(table_name)`` with ``meta`` = plan id, status, objective, solve time, and the retry
   ratio ``retry.ratio`` (× ``shed_retry_factor`` = 0.2 while any class is shed); the same
   generation is kept as a wire snapshot for ``GET /v1/table``.

On :class:`SolveError`, invalid weights or a table error the last good table stays published, the
alert counter ``fastroute_controller_alerts_total{kind}`` increments and the error is logged (once
per distinct message in a row).

**Derating** (:mod:`controller.health`): the proxies' per-engine report entries are summed per
period; at the start of each period :class:`controller.health.HealthTracker` scores the window
(residual vs profile, robust z within the peer group, error rate) and steps health levels
``h ∈ {0, .25, .5, .75, 1}`` with hysteresis. A change regroups nothing (only ``C · h`` changes,
the engine keeps its group); level 0 publishes ``FLAG_UNAVAILABLE`` for the engine. Not done here:
P/D pairs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from controller.calibration import CalibrationBoard
from controller.demand import DemandForecaster, carry_forecast
from controller.explain import classes_json, engines_json, plan_fields, prefix_cache_json
from controller.ha import ControllerHa
from controller.health import LevelChange
from controller.learning import FleetLearning
from controller.metrics import ControllerMetrics
from controller.model import FleetModel, Plan
from controller.options import ControllerOptions
from controller.planner import PeriodInputs, PeriodPlan, PlanningError, make_planner
from controller.publish import TablePublisher
from controller.scrape import EngineScraper, ScrapeWindow
from controller.tenant_demand import TenantBoard
from controller.why import PlanContext, explain_engines
from fastroute.config import Config
from fastroute.errors import TableError, TableFencedError
from fastroute.signals.reports import Report
from fastroute.tables import TableSnapshot

__all__ = ["ControllerService", "ReloadOutcome"]

log = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class ReloadOutcome:
    """What :meth:`ControllerService.reload` did.

    Attributes
    ----------
    changed : bool
        The config differed and the service now runs on it (False: identical, nothing done).
    needs_restart : tuple of str
        Changes that were not applied (the old value is kept) because only a restart can.
    """

    changed: bool
    needs_restart: tuple[str, ...] = ()


#: State a reload keeps from the running service (everything else comes from the new config).
_KEPT_ON_RELOAD = frozenset(
    {
        "publisher",
        "calibration",
        "_plan_id",
        "periods_total",
        "last_error",
        "reloads_total",
        "last_reload_error",
        "_step_lock",
        "_stop",
        "_scrape_task",
        "metrics",
        "options",
    }
)


class ControllerService:
    """Runs the control loop and holds the current table and plan.

    Parameters
    ----------
    config : Config
    options : ControllerOptions, optional
        Planner, table name and tunables (default: ``ControllerOptions()``).
    metrics : ControllerMetrics, optional
    clock : callable
        Unix seconds (default ``time.time``): report receipt, demand periods and derating windows.

    Attributes
    ----------
    learning : FleetLearning
        Derating levels, fitted profiles and the current :attr:`model`.
    planner : Planner
        The period planner ``options.mode`` names (:mod:`controller.planner`).
    publisher : TablePublisher
        The table, the snapshot in force and its long-poll.
    plan : Plan or None
        The plan in force (None before the first, and after a reload until the next).
    """

    def __init__(
        self,
        config: Config,
        options: ControllerOptions | None = None,
        *,
        metrics: ControllerMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        opts = self.options = options or ControllerOptions()
        self.config = config
        self.clock = clock
        self.table_name = opts.table_name or config.proxy.table_name
        self.metrics = metrics or ControllerMetrics()
        self.period_s = config.controller.period_s
        self.shed_retry_factor = opts.shed_retry_factor
        model = FleetModel.from_config(config, default_fraction=opts.default_fraction)
        self.forecaster = DemandForecaster(
            [c.key for c in model.classes],
            [c.cluster for c in model.classes],
            period_s=self.period_s,
        )
        self.learning = FleetLearning(config, model, opts)
        self.planner = make_planner(model, config.controller, opts)
        #: The proxies' reported step-time calibration, published to new workers.
        self.calibration = CalibrationBoard()
        #: Per-tenant demand by proxy and priority: the tenant shares in the meta.
        self.tenants = TenantBoard(config, self.period_s)
        self.scraper = EngineScraper(
            config.engines,
            interval_s=config.controller.scrape_interval_s,
            timeout_s=config.controller.scrape_timeout_s,
            clock=clock,
        )
        self.last_scrape: ScrapeWindow | None = None
        republish_after_s = (
            10.0 * self.period_s if opts.republish_after_s is None else opts.republish_after_s
        )
        self.publisher = TablePublisher(self.table_name, clock, republish_after_s)
        for name in model.engine_names:
            self.metrics.engine_health.labels(name).set(1.0)
            self.metrics.engine_reuse_gain.labels(name).set(1.0)
        self.plan: Plan | None = None
        self.last_error: str | None = None
        self.periods_total = 0
        self._plan_id = 0
        self._step_lock = asyncio.Lock()
        self._stop = asyncio.Event()
        self._scrape_task: asyncio.Task[None] | None = None
        #: Successful reloads that changed the config, and the last failed reload's message
        #: (cleared by the next successful one).
        self.reloads_total = 0
        self.last_reload_error: str | None = None
        #: The etcd election when ``[controller.ha]`` names etcd (None: one controller, always
        #: publishing, no epoch in the tables).
        self.ha: ControllerHa | None = (
            ControllerHa(config.controller.ha) if config.controller.ha.etcd_urls else None
        )

    @property
    def model(self) -> FleetModel:
        """The fleet model the next period plans on (:attr:`FleetLearning.model`)."""
        return self.learning.model

    @property
    def snapshot(self) -> TableSnapshot | None:
        """The table generation in force (None before the first publish)."""
        return self.publisher.snapshot

    @property
    def generation(self) -> int:
        """Generation of the current snapshot, 0 before the first."""
        return self.publisher.generation

    # -- life cycle -----------------------------------------------------------------------------

    def open(self) -> None:
        """Open (or take over) the table; raises ``TableLockedError`` if another writer holds it."""
        self.publisher.open(len(self.model.engine_names), len(self.model.classes))

    def close(self) -> None:
        """Stop writing. The table file stays: proxies keep routing on the last weights."""
        self.publisher.close()

    def stop(self) -> None:
        """Ask :meth:`run` to return after the current period (never mid-solve)."""
        self._stop.set()

    async def aclose(self) -> None:
        """:meth:`close` once no period is running."""
        async with self._step_lock:
            self.close()

    def start_scrapes(self) -> None:
        """Run :attr:`scraper` in a task (until :meth:`stop_scrapes`; a reload may swap it)."""
        if self._scrape_task is None:
            self._scrape_task = asyncio.create_task(self.scraper.run(), name="controller-scrapes")

    async def stop_scrapes(self) -> None:
        """Cancel the scrape task and close the scraper's HTTP session."""
        task, self._scrape_task = self._scrape_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.scraper.close()

    async def reload(self, config: Config) -> ReloadOutcome:
        """Switch to ``config`` between two periods, keeping the table and its generations.

        The service is rebuilt for the new config (classes, engines, RTTs, profiles seeds, LP,
        controller settings) by constructing a fresh :class:`ControllerService` with the same
        options and adopting its state, so a config the service cannot be built from changes
        nothing. Kept: the table publisher (generations only increase), the current snapshot and
        parked long-polls, plan ids, counters, the metrics registry. Carried over: demand
        forecasts of classes that still exist (:func:`controller.demand.carry_forecast`); derating
        levels and fitted profiles when the engines, breakpoints and derating settings are
        unchanged (else they restart from the seeds); the scraper when the engines and scrape
        settings are unchanged.

        Not applied live (logged, the old value kept, see ``ReloadOutcome.needs_restart``): the
        table name. A new plan is solved and published at once (a new generation even when the
        weights come out equal); until it is, ``plan`` is None.

        Raises
        ------
        ValueError
            The new config cannot be served by this process (the old one stays in force): more
            engines or classes than the open table holds, or the service rejects it.
        """
        async with self._step_lock:
            needs_restart: list[str] = []
            if self.options.table_name is None and config.proxy.table_name != self.table_name:
                needs_restart.append(
                    f"proxy.table_name {self.table_name!r} -> {config.proxy.table_name!r}"
                )
                config = msgspec.structs.replace(
                    config,
                    proxy=msgspec.structs.replace(config.proxy, table_name=self.table_name),
                )
            if config == self.config:
                return ReloadOutcome(changed=False, needs_restart=tuple(needs_restart))
            # built aside (own throwaway metrics): a config it rejects changes nothing here
            fresh = ControllerService(
                config,
                msgspec.structs.replace(self.options, table_name=self.table_name),
                metrics=ControllerMetrics(),
                clock=self.clock,
            )
            self._check_table_holds(fresh.model)
            kept_learning = await self._adopt(fresh)
            log.info(
                "config reloaded (%d engines, %d classes); derating and profiles %s",
                len(self.model.engine_names),
                len(self.model.classes),
                "kept" if kept_learning else "restart from the seeds",
            )
            try:
                await self._step()
            except Exception:  # the plan follows at the next period
                log.exception("first period after the reload failed")
            return ReloadOutcome(changed=True, needs_restart=tuple(needs_restart))

    def _check_table_holds(self, model: FleetModel) -> None:
        """Raise ValueError when the open table is too small for ``model``."""
        writer = self.publisher.writer
        if writer is None:
            return
        layout = writer.layout
        n_e, n_g = len(model.engine_names), len(model.classes)
        if n_e > layout.max_engines or n_g > layout.max_classes:
            raise ValueError(
                f"the new config has {n_g} classes x {n_e} engines but the open table "
                f"holds at most {layout.max_classes} x {layout.max_engines}: needs a "
                "restart"
            )

    async def _adopt(self, fresh: ControllerService) -> bool:
        """Become ``fresh`` (built for the new config) but for the kept state; return whether the
        learnt derating and profiles were carried over."""
        old, new = self.config.controller, fresh.config.controller
        same_engines = fresh.config.engines == self.config.engines
        carry_forecast(self.forecaster, fresh.forecaster)
        kept_learning = (
            same_engines and new.breakpoints == old.breakpoints and new.derating == old.derating
        )
        fresh.learning.adopt(self.learning, learnt=kept_learning)
        same_scrapes = same_engines and (new.scrape_interval_s, new.scrape_timeout_s) == (
            old.scrape_interval_s,
            old.scrape_timeout_s,
        )
        scraping = self._scrape_task is not None
        if same_scrapes:
            fresh.scraper = self.scraper
        else:
            await self.stop_scrapes()
        gone_engines = set(self.model.engine_names) - set(fresh.model.engine_names)
        gone_classes = {c.name for c in self.model.classes} - {c.name for c in fresh.model.classes}
        self.metrics.forget(sorted(gone_engines), sorted(gone_classes))
        self.publisher.republish_after_s = fresh.publisher.republish_after_s
        for key, value in vars(fresh).items():
            if key not in _KEPT_ON_RELOAD:
                setattr(self, key, value)
        learnt = self.learning
        for name, h, g in zip(
            self.model.engine_names, learnt.health.health, learnt.reuse_gain, strict=True
        ):
            self.metrics.engine_health.labels(name).set(float(h))
            self.metrics.engine_reuse_gain.labels(name).set(float(g))
        if scraping and not same_scrapes:
            self.start_scrapes()
        self.reloads_total += 1
        self.last_reload_error = None
        return kept_learning

    async def run(self) -> None:
        """Step every ``period_s`` until :meth:`stop` (a failed step never ends the loop).

        Stopping instead of cancelling lets a solve running in the worker thread finish before the
        table is closed.
        """
        loop = asyncio.get_running_loop()
        next_t = loop.time()
        while not self._stop.is_set():
            try:
                await self.step()
            except Exception:  # the loop must survive anything
                log.exception("controller period failed")
            next_t += self.period_s
            now = loop.time()
            if next_t < now:  # overran: skip missed ticks, keep the phase
                next_t += self.period_s * float(np.ceil((now - next_t) / self.period_s))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), next_t - now)

    # -- inputs ---------------------------------------------------------------------------------

    def observe(self, report: Report) -> None:
        """Feed one decoded proxy report into the demand forecast, the derating window and
        (when it carries one) the calibration board."""
        self.forecaster.observe(report, self.clock())
        self.learning.observe(report)
        self.tenants.observe(report)
        if report.calibration is not None:
            self.calibration.observe(report.worker_id, report.calibration)

    # -- one period -----------------------------------------------------------------------------

    def demand(self) -> FloatArray:
        """The current forecast per class (req/s)."""
        return self.forecaster.forecast(self.model.default_rps, self.model.floor_rps)

    async def step(self) -> bool:
        """Run one period; return whether a new table generation was published.

        A plan whose weights, shed fractions and retry ratio equal the published ones (bitwise; the
        κ fixed point makes an unchanged input reproduce them exactly) updates ``plan`` but
        publishes no new generation, so parked long-polls are not woken for nothing; except when
        the table in force is ``republish_after_s`` old (a heartbeat: the proxies' table age then
        stays bounded while the controller lives).
        """
        async with self._step_lock:
            return await self._step()

    def close_window(self, now_s: float) -> list[LevelChange]:
        """Close the period's signal and scrape windows: derating levels, the online profile fit
        and the reuse gains (:meth:`FleetLearning.close_window`); log and export the level
        changes and the gains that moved."""
        scraped = self.scraper.drain(now_s)
        self.last_scrape = scraped
        self.metrics.record_scrapes(self.model.engine_names, self.scraper, now_s)
        gain_before = self.learning.reuse_gain
        changes = self.learning.close_window(now_s, scraped)
        for i in np.flatnonzero(self.learning.reuse_gain != gain_before):
            name = self.model.engine_names[i]
            self.metrics.engine_reuse_gain.labels(name).set(float(self.learning.reuse_gain[i]))
        for c in changes:
            log.log(
                logging.WARNING if c.new_health < c.old_health else logging.INFO,
                "engine %s health %.2f -> %.2f: %s",
                c.name,
                c.old_health,
                c.new_health,
                c.reason,
            )
            self.metrics.engine_health.labels(c.name).set(c.new_health)
        return changes

    def _period_inputs(self, now_s: float) -> PeriodInputs:
        m = self.model
        return PeriodInputs(
            model=m,
            demand_rps=self.demand(),
            live_demand_rps=self.forecaster.level(m.default_rps, m.floor_rps),
            now_s=now_s,
            engine_flags=self.learning.engine_flags(),
            window=self.learning.last_window,
            health=self.learning.health.health,
            measured=self.forecaster.measured,
        )

    async def _step(self) -> bool:
        self.periods_total += 1
        now_s = self.clock()
        self.forecaster.update(now_s)
        self.close_window(now_s)
        if not self._may_publish():  # warm standby: windows and profile fits, no solve
            return False
        inputs = self._period_inputs(now_s)
        t0 = time.perf_counter()
        try:
            period = await self.planner.plan(inputs)
        except PlanningError as exc:
            self.metrics.solves.labels(status=exc.status).inc()
            self._alert(exc.kind, str(exc))
            return False
        # every period counts by its plan's status (alerts watch that rate); timings are solves'
        self.metrics.solves.labels(status=period.result.status).inc()
        if period.reused:
            self.metrics.solves_reused.inc()
        else:
            self.metrics.solve_seconds.observe(time.perf_counter() - t0)
        retry = self.config.retry.ratio
        if float(period.shed_fraction.max(initial=0.0)) > 1e-9:
            retry *= self.shed_retry_factor
        plan_id = self._plan_id + 1
        w, sigma, flags = period.weights, period.shed_fraction, inputs.engine_flags
        previous_tenant_meta = self.tenants.last_meta
        self.tenants.close_period()
        tenant_meta = self.tenants.meta(self._shed_by_priority(inputs.demand_rps, sigma))
        # nothing new for the data planes: no new generation, no long-poll wake-up
        unchanged = (
            self.publisher.unchanged(self.plan, w, sigma, retry, flags)
            and tenant_meta == previous_tenant_meta
            and self.snapshot is not None
            and self.snapshot.meta.get("epoch") == self._epoch()
        )  # a new term republishes at once, stamped with the new epoch
        if unchanged:
            snap = self.publisher.snapshot
            assert snap is not None
        else:
            if not self._may_publish():  # the lease may have lapsed during the solve
                return False
            try:
                snap = await self.publisher.publish(
                    self.model,
                    w,
                    sigma,
                    retry,
                    {**_meta(plan_id, period, self._epoch()), **tenant_meta},
                    flags,
                )
            except TableFencedError as exc:
                self.metrics.tables_fenced.inc()
                self._alert("fenced", str(exc))
                return False
            except (TableError, ValueError, OSError) as exc:
                self._alert("publish_error", str(exc))
                return False
        self._plan_id = plan_id
        self.planner.accepted(inputs, period)
        self._adopt_plan(_make_plan(plan_id, snap, inputs, period, retry))
        if unchanged:
            return False
        self.publisher.notify_changed()
        return True

    def _shed_by_priority(self, demand_rps: FloatArray, sigma: FloatArray) -> dict[str, float]:
        """The demand-weighted shed fraction of each priority over its classes."""
        offered: dict[str, float] = {}
        shed: dict[str, float] = {}
        for c, d, f in zip(self.model.classes, demand_rps, sigma, strict=True):
            offered[c.priority] = offered.get(c.priority, 0.0) + float(d)
            shed[c.priority] = shed.get(c.priority, 0.0) + float(d) * float(f)
        return {p: (shed[p] / offered[p] if offered[p] > 0 else 0.0) for p in offered}

    def _may_publish(self) -> bool:
        """No election, or this replica leads."""
        return self.ha is None or self.ha.leading()

    def _epoch(self) -> int | None:
        return None if self.ha is None else self.ha.epoch

    def _adopt_plan(self, plan: Plan) -> None:
        """``plan`` is in force: keep it, clear the error, export its gauges."""
        self.plan = plan
        if self.last_error is not None:
            log.info("controller recovered: plan %d published", plan.plan_id)
        self.last_error = None
        self.metrics.generation.set(plan.generation)
        for c, s, d in zip(self.model.classes, plan.shed_fraction, plan.demand_rps, strict=True):
            self.metrics.shed_fraction.labels(c.name).set(float(s))
            self.metrics.demand_rps.labels(c.name).set(float(d))

    def _alert(self, kind: str, message: str) -> None:
        self.metrics.alerts.labels(kind=kind).inc()
        if message != self.last_error:
            log.error("controller keeps the last good table (%s): %s", kind, message)
        self.last_error = message

    # -- explain --------------------------------------------------------------------------------

    def plan_json(self) -> dict[str, Any]:
        """The current plan as a JSON-able dict (``GET /v1/plan``)."""
        learning = self.learning
        out: dict[str, Any] = {
            "mode": self.planner.mode,
            "plan_id": None,
            "generation": self.generation,
            "period_s": self.period_s,
            "periods_total": self.periods_total,
            "last_error": self.last_error,
            "live_workers": self.forecaster.live_workers,
            "engines": engines_json(learning, self.scraper, self.plan, self.clock()),
            "prefix_cache": prefix_cache_json(self.scraper, self.clock()),
            "profiles": learning.fitter.state(),
            "profile_updates_total": learning.profile_updates_total,
            "reprofiles_total": learning.reprofiles_total,
            "classes": [],
            "ha": None if self.ha is None else self.ha.plan_json(),
        }
        if self.plan is not None:
            out.update(plan_fields(self.plan))
            out["classes"] = classes_json(self.plan, self.model)
            ctx = PlanContext(
                learning.model,
                self.plan,
                [e["derating"] for e in out["engines"]],
                kappa_s=self.config.controller.kappa_s,
            )
            for e, why in zip(out["engines"], explain_engines(ctx), strict=True):
                e["why"] = why
        out["tenants"] = self.tenants.plan_json()
        return out


def _meta(plan_id: int, period: PeriodPlan, epoch: int | None) -> dict[str, Any]:
    """The table's ``meta`` for a new generation of ``period``; ``epoch`` (the leader's, for
    the proxies' fence) only under an election."""
    res = period.result
    meta: dict[str, Any] = {
        "plan_id": plan_id,
        "status": res.status,
        "objective": res.objective,
        "solve_time_s": res.solve_time_s,
    }
    if epoch is not None:
        meta["epoch"] = epoch
    return meta


def _make_plan(
    plan_id: int, snap: TableSnapshot, inputs: PeriodInputs, period: PeriodPlan, retry: float
) -> Plan:
    return Plan(
        plan_id=plan_id,
        generation=snap.generation,
        created_at_s=snap.published_at,
        demand_rps=inputs.demand_rps,
        measured=inputs.measured,
        x_rps=period.x_rps,
        weights=period.weights,
        shed_fraction=period.shed_fraction,
        marginal_cost_s=period.result.marginal_cost_s,
        retry_ratio=retry,
        result=period.result,
        health=inputs.health,
        engine_flags=inputs.engine_flags,
    )
