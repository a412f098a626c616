"""fastroute variants as routers: resolution, the rendered policy params, no-controller configs."""

from __future__ import annotations

import pytest

from fastroute.config import decode_config
from fastroute.fleetbench.configgen import ProxySettings, render_config
from fastroute.fleetbench.fleet import EngineGroup, FleetSpec, RegionSpec, plan_engines
from fastroute.fleetbench.routers import resolve_router
from fastroute.fleetbench.spec import FastrouteVariant

VARIANTS = {
    "mc-uncal": FastrouteVariant(
        policy="marginal-cost", params={"calibrate": False, "infeasible": "reject"}
    ),
    "mc-cal": FastrouteVariant(policy="marginal-cost", params={"calibrate": True}),
}
FLEET = FleetSpec(
    regions=(RegionSpec(name="local"),),
    groups=(
        EngineGroup(name="p", model="qwen2.5-3b", region="local", role="prefill",
                    profile="a40-qwen2.5-3b", step_time_factors={"b0_s": 1.5}),
        EngineGroup(name="d", model="qwen2.5-3b", region="local", role="decode",
                    profile="a40-qwen2.5-3b", count=2),
    ),
)  # fmt: skip


def test_variant_names_resolve_to_fastroute_with_params() -> None:
    plan = resolve_router("mc-uncal", {}, VARIANTS)
    assert (plan.kind, plan.policy, plan.unavailable) == ("fastroute", "marginal-cost", None)
    assert plan.params == {"calibrate": False, "infeasible": "reject"}
    assert resolve_router("fastroute:least-request", {}, VARIANTS).params is None
    with pytest.raises(ValueError, match="known: .*mc-uncal, mc-cal"):
        resolve_router("mc-fast", {}, VARIANTS)


def test_every_policy_is_a_fastroute_router_and_unknown_ones_are_refused() -> None:
    plan = resolve_router("fastroute:length-heuristic", {})
    assert (plan.kind, plan.policy, plan.unavailable) == ("fastroute", "length-heuristic", None)
    with pytest.raises(ValueError, match="unknown fastroute policy"):
        resolve_router("fastroute:fastest", {})


@pytest.mark.parametrize("name", ["mc-uncal", "mc-cal"])
def test_the_config_carries_the_variants_params_and_the_datasheet_profile(name: str) -> None:
    engines = plan_engines(FLEET)
    plan = resolve_router(name, {}, VARIANTS)
    text = render_config(
        FLEET, engines, ProxySettings("local", 8080, "fastroute-test-stats"),
        table_name="fastroute-test-w", controller_port=8090, policy=plan.policy or "",
        policy_params=plan.params, slo_s={"qwen2.5-3b": (0.175, 0.0397)},
    )  # fmt: skip
    config = decode_config(text, source="test")
    assert config.policy.default == "marginal-cost"
    assert config.policy.params == {"marginal-cost": dict(VARIANTS[name].params)}
    assert {e.hardware for e in config.engines} == {"a40-qwen2.5-3b"}  # not told the factors
    assert [e.role for e in config.engines] == ["prefill", "decode", "decode"]
    (cls,) = config.classes
    assert (cls.ttft_slo_s, cls.tbot_slo_s) == (0.175, 0.0397)
    assert config.proxy.controller_url is None


def test_a_controller_url_is_rendered_only_when_given() -> None:
    engines = plan_engines(FLEET)
    text = render_config(
        FLEET, engines, ProxySettings("local", 8080, "fastroute-test-stats"),
        table_name="fastroute-test-w", controller_port=8090,
        controller_url="http://127.0.0.1:8090",
    )  # fmt: skip
    config = decode_config(text, source="test")
    assert config.proxy.controller_url == "http://127.0.0.1:8090"
    assert config.policy.params == {}


def test_a_hardware_label_replaces_the_profile_name_in_the_config() -> None:
    """The "unprofiled" start: the router knows the engines by an operator's label."""
    groups = tuple(
        EngineGroup(name=g.name, model=g.model, region=g.region, role=g.role, count=g.count,
                    profile=g.profile, step_time_factors=g.step_time_factors, hardware="a40-48g")
        for g in FLEET.groups
    )  # fmt: skip
    fleet = FleetSpec(regions=FLEET.regions, groups=groups)
    engines = plan_engines(fleet)
    assert {e.profile for e in engines} == {"a40-qwen2.5-3b"}  # the engines run the profile
    text = render_config(
        fleet, engines, ProxySettings("local", 8080, "fastroute-test-stats"),
        table_name="fastroute-test-w", controller_port=8090,
    )  # fmt: skip
    assert {e.hardware for e in decode_config(text, source="test").engines} == {"a40-48g"}


def test_a_variants_hardware_label_applies_to_every_engine_of_its_config() -> None:
    variants = {"unprof": FastrouteVariant(policy="marginal-cost", hardware="a40-48g")}
    plan = resolve_router("unprof", {}, variants)
    assert plan.hardware == "a40-48g" and resolve_router("mc-cal", {}, VARIANTS).hardware is None
    text = render_config(
        FLEET, plan_engines(FLEET), ProxySettings("local", 8080, "fastroute-test-stats"),
        table_name="fastroute-test-w", controller_port=8090, policy="marginal-cost",
        hardware=plan.hardware,
    )  # fmt: skip
    config = decode_config(text, source="test")
    assert {e.hardware for e in config.engines} == {"a40-48g"}
    assert "a40-48g" in config.hardware_classes and "a40" in config.hardware_classes


def test_a_hedge_variant_hedges_its_classes() -> None:
    variants = {"hedged": FastrouteVariant(policy="prefix-hrw", hedge=True)}
    plan = resolve_router("hedged", {}, variants)
    assert plan.hedge and not resolve_router("mc-cal", {}, VARIANTS).hedge
    for hedge in (True, False):
        text = render_config(
            FLEET, plan_engines(FLEET), ProxySettings("local", 8080, "fastroute-test-stats"),
            table_name="fastroute-test-w", controller_port=8090, hedge=hedge,
            slo_s={"qwen2.5-3b": (0.175, 0.0397)},
        )  # fmt: skip
        (cls,) = decode_config(text, source="test").classes
        assert cls.hedge is hedge


def test_a_variant_sets_workers_and_proxies_within_bounds() -> None:
    import msgspec

    plan = resolve_router(
        "split", {}, {"split": FastrouteVariant(policy="prefix-hrw", workers=4, proxies=2)}
    )
    assert (plan.workers, plan.proxies) == (4, 2)
    engines = plan_engines(FLEET)
    text = render_config(
        FLEET, engines, ProxySettings("local", 8080, "fastroute-test-stats", workers=plan.workers),
        table_name="fastroute-test-w", controller_port=8090,
    )  # fmt: skip
    assert decode_config(text, source="test").proxy.workers == 4
    assert decode_config(text, source="test").proxy.peers == ()
    assert plan.peers  # several proxies poll each other unless the variant says not
    peers = ("http://127.0.0.1:8081",)
    text = render_config(
        FLEET, engines, ProxySettings("local", 8080, "fastroute-test-stats", peers=peers),
        table_name="fastroute-test-w", controller_port=8090,
    )  # fmt: skip
    assert decode_config(text, source="test").proxy.peers == peers
    alone = FastrouteVariant(policy="prefix-hrw", proxies=2, peers=False)
    assert not resolve_router("alone", {}, {"alone": alone}).peers
    for bad in ({"workers": 0}, {"workers": 17}, {"proxies": 0}, {"proxies": 9}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({"policy": "prefix-hrw", **bad}, FastrouteVariant)


def test_a_variants_proxy_keys_reach_the_config_and_bad_ones_are_refused(tmp_path) -> None:
    from pathlib import Path

    from fastroute.fleetbench.spec import BenchSpecError, load_spec

    plan = resolve_router(
        "nolog", {}, {"nolog": FastrouteVariant(policy="prefix-hrw", proxy={"key_log_entries": 0})}
    )
    assert plan.proxy_settings == {"key_log_entries": 0}
    settings = ProxySettings("local", 8080, "fastroute-test-stats", extra=plan.proxy_settings)
    text = render_config(
        FLEET, plan_engines(FLEET), settings, table_name="fastroute-test-w", controller_port=8090
    )
    assert decode_config(text, source="test").proxy.key_log_entries == 0
    spec = Path("examples/bench/families/sensitivity/keylog-bursts-70.toml").read_text()
    for bad, message in [
        ("{ key_log_entries = 24 }", "power of two"),
        ("{ bogus = 1 }", "bogus"),
        ("{ workers = 2 }", "set by the benchmark"),
    ]:
        path = tmp_path / "spec.toml"
        path.write_text(spec.replace("{ key_log_entries = 0 }", bad))
        with pytest.raises(BenchSpecError, match=message):
            load_spec(path)
