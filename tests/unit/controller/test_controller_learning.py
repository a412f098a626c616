"""controller.learning: the fleet model as learnt, flags from health, what a reload carries over.

The scoring, fitting and re-profiling themselves are tested through the service
(tests/integration/controller/test_controller_service_profiles.py, test_controller_derating.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from controller.learning import FleetLearning
from controller.model import FleetModel
from controller.options import ControllerOptions
from controller.scrape import ScrapeWindow
from fastroute.config import Config, decode_config
from fastroute.signals.prefix_cache import PrefixHitRate
from fastroute.tables import FLAG_UNAVAILABLE

MODEL = "demo-8b"


def config() -> Config:
    return config_with("")


def config_with(extra_toml: str) -> Config:
    engines = "".join(
        f'[[engines]]\nname = "engine-{i}"\nurl = "http://127.0.0.1:{9 + i}"\n'
        f'models = ["{MODEL}"]\nregion = "east"\nhardware = "{hw}"\ncapacity_rps = 10.0\n\n'
        for i, hw in enumerate(("h100", "h100", "a40"))
    )
    toml = engines + '[[network.regions]]\nname = "east"\n\n[proxy]\ncluster = "east"\n'
    return decode_config(toml + extra_toml, source="test.toml")


def learning(options: ControllerOptions | None = None) -> FleetLearning:
    cfg = config()
    return FleetLearning(cfg, FleetModel.from_config(cfg), options or ControllerOptions())


def test_fit_groups_and_defaults_come_from_the_config_and_options() -> None:
    """One fit group per (hardware, models, region, role); re-profiling after
    ``4 · exit_windows`` by default, or the options' value; below 1 is refused."""
    fl = learning()
    assert fl.fit_group.tolist() == [0, 0, 1]
    assert list(fl.fitter.group_names) == ["h100/demo-8b/east/both", "a40/demo-8b/east/both"]
    assert fl.reprofile_after_windows == 4 * config().controller.derating.exit_windows
    assert learning(ControllerOptions(reprofile_after_windows=2)).reprofile_after_windows == 2
    with pytest.raises(ValueError, match="reprofile_after_windows"):
        learning(ControllerOptions(reprofile_after_windows=0))


def test_engines_derated_to_zero_are_flagged_unavailable() -> None:
    fl = learning()
    assert fl.engine_flags().tolist() == [0, 0, 0]
    fl.health.level[1] = 0  # LEVELS[0]: h = 0
    assert fl.engine_flags().tolist() == [0, FLAG_UNAVAILABLE, 0]


def test_an_empty_window_changes_nothing() -> None:
    """Closing a window without signals keeps the model object (no regroup) and full health."""
    fl = learning()
    model = fl.model
    assert fl.close_window(1_000.0, None) == []
    assert fl.model is model and fl.last_window is not None
    np.testing.assert_array_equal(fl.health.health, 1.0)


def test_adopt_carries_counters_always_and_the_learnt_state_when_asked() -> None:
    """A reload keeps the counters; the derating and fit state only for the same fleet, and
    then the model's groups follow the adopted health."""
    old = learning()
    old.profile_updates_total, old.reprofiles_total = 3, 1
    old.health.level[2] = 2  # LEVELS[2]: h = 0.5
    fresh = learning()
    fresh.adopt(old, learnt=False)
    assert (fresh.profile_updates_total, fresh.reprofiles_total) == (3, 1)
    assert fresh.health is not old.health and fresh.fitter is not old.fitter
    again = learning()
    again.adopt(old, learnt=True)
    assert again.health is old.health and again.fitter is old.fitter
    assert again.model.groups.engine_capacity_rps[2] == pytest.approx(5.0)


def _scraped(n: int, hits: list[PrefixHitRate]) -> ScrapeWindow:
    nan = np.full(n, np.nan)
    zeros = np.zeros(n)
    return ScrapeWindow(
        ttft_count=zeros, ttft_sum_s=zeros, tbot_count=zeros, tbot_sum_s=zeros,
        load_rps=nan, running=nan, waiting=nan, kv_cache_usage=nan,
        stale=np.zeros(n, dtype=bool), prefix_hits=tuple(hits),
    )  # fmt: skip


def _window(queried: float, hit: float, generated: float | None) -> PrefixHitRate:
    return PrefixHitRate(
        status="ok", rate=hit / queried, source="counters", hits_tokens=hit,
        queries_tokens=queried, generated_tokens=generated, engines=1,
    )  # fmt: skip


def test_measured_reuse_raises_the_planned_capacity_of_its_peer_group() -> None:
    """The two h100s cache 4/5 of 1000 queried tokens each (gain 5 → the cap, 4); the a40 does
    not count generated tokens, so its capacity stays nominal. The groups follow; a window
    without reuse puts the capacities back."""
    fl = learning()
    fl.health.health[:] = 1.0
    reused = [_window(1000, 800, 0), _window(1000, 800, 0), _window(1000, 900, None)]
    assert fl.close_window(1_000.0, _scraped(3, reused)) == []
    assert fl.reuse_gain.tolist() == [4.0, 4.0, 1.0]
    assert fl.model.groups.engine_capacity_rps.tolist() == pytest.approx([40.0, 40.0, 10.0])
    np.testing.assert_array_equal(fl.model.capacity_rps, 10.0)  # the rating is unchanged
    cold = [_window(1000, 0, 100)] * 3
    fl.close_window(1_005.0, _scraped(3, cold))
    assert fl.model.groups.engine_capacity_rps.tolist() == pytest.approx([10.0, 10.0, 10.0])
    capped = FleetLearning(
        config_with("[controller]\nmax_reuse_gain = 1.0\n"), fl.model, ControllerOptions()
    )
    capped.close_window(1_000.0, _scraped(3, reused))
    assert capped.reuse_gain.tolist() == [1.0, 1.0, 1.0]
