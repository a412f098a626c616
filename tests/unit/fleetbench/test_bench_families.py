"""Bench specs with a ``[family]``: loading, checks, and the sessions the driver sends."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastroute.fleetbench.families import family_rate_rps
from fastroute.fleetbench.runner import build_sessions, target_rps
from fastroute.fleetbench.spec import BenchSpec, BenchSpecError, load_spec
from fastroute.sim.scenario import load_scenario
from fastroute.workload.family_gen import family_sessions

REPO = Path(__file__).resolve().parents[3]
SPECS = REPO / "examples" / "bench" / "families"


def test_every_family_spec_loads_at_70_and_90_percent():
    paths = sorted(SPECS.glob("*.toml"))
    assert len(paths) == 16
    for path in paths:
        spec = load_spec(path)
        assert spec.family is not None and spec.workload is None and spec.replay is None
        assert spec.load in (0.7, 0.9) and path.stem.endswith(f"-{round(spec.load * 100)}")
        assert sum(g.count for g in spec.fleet.groups) == 4 and len(spec.fleet.models) == 1


def test_bench_and_simulator_send_the_same_requests_for_a_family():
    spec = load_spec(SPECS / "mooncake-70.toml")
    sessions, sources, text = build_sessions(spec)
    assert sources == ["local"] and "family prefix-tree" in text
    rate = 0.7 * 4 * spec.fleet.groups[0].capacity_rps
    assert target_rps(spec) == family_rate_rps(spec) == pytest.approx(rate)
    scenario = load_scenario(REPO / "examples" / "scenarios" / "families" / "mooncake.toml")
    import msgspec

    family = msgspec.structs.replace(scenario.family, rate_rps=rate)
    same = family_sessions(
        family,
        duration_s=spec.warmup_s + spec.duration_s,
        sources=("local",),
        seed=spec.seed,
        base_dir=scenario.base_dir,
    )
    assert sessions == same and len(sessions) > 50


def _write(tmp_path: Path, base: str, **replace: str) -> Path:
    text = (SPECS / base).read_text()
    for old, new in replace.items():
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / "spec.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("load = 0.70", "concurrency = 4", r"\[family\] is open loop"),
        ('kind = "rag"', 'kind = "rag"\nmodel = "gpt"', "family model 'gpt'"),
        ("mooncake-fast25-synthetic-1000.jsonl", "no.jsonl", "trace file not found"),
        ("documents = 256", "documents = 0", "documents must be >= 1"),
        ('kind = "rag"', 'kind = "rag"\n[workload]\nmean_turns = 2.0', "exactly one of"),
    ],
)
def test_family_spec_errors_name_the_problem(tmp_path, old, new, message):
    with pytest.raises(BenchSpecError, match=message):
        base = "mooncake-70.toml" if "jsonl" in old else "rag-70.toml"
        load_spec(_write(tmp_path, base, **{old: new}))


def test_bench_capacity_of_a_family_is_the_simulators_saturation_capacity():
    from fastroute.emulator.model import EngineConfig
    from fastroute.fleetbench.families import saturation_capacity
    from fastroute.hardware import get_profile
    from fastroute.sim.capacity import request_shapes, saturation_capacity_rps

    spec = load_spec(SPECS / "hot-prompt-70.toml")
    profile = spec.fleet.groups[0].profile
    sample = family_sessions(spec.family, duration_s=90.0, sources=("local",), seed=spec.seed)
    shapes = request_shapes(sample, 384, seed=spec.seed)
    sim = saturation_capacity_rps(get_profile(profile), EngineConfig(), shapes)
    assert saturation_capacity(spec, profile) == pytest.approx(sim, rel=1e-9)
    assert saturation_capacity(spec, profile) == pytest.approx(
        spec.fleet.groups[0].capacity_rps, abs=0.01
    )


def _assert_same_requests(base: BenchSpec, variant: BenchSpec) -> None:
    """``variant`` sends ``base``'s requests to the same fleet: only name and routers differ."""
    assert build_sessions(variant) == build_sessions(base)
    assert (variant.fleet, variant.load, variant.seed, variant.slo) == (
        base.fleet,
        base.load,
        base.seed,
        base.slo,
    )


@pytest.mark.parametrize("family", ["agentic", "chat"])
def test_a_sensitivity_spec_is_its_family_spec_with_other_routers(family: str) -> None:
    """The affinity_slack sensitivity runs (docs/fleet-benchmark.md) send the family spec's
    requests: everything but the name and the routers is the same."""
    base = load_spec(SPECS / f"{family}-70.toml")
    variant = load_spec(SPECS / "sensitivity" / f"affinity-slack-{family}-70.toml")
    _assert_same_requests(base, variant)
    assert variant.routers == ("s0", "s1", "pb_s0", "pb_s1")


@pytest.mark.parametrize(
    "family",
    ["prefix-tree-90", "long-tail-90", "mooncake-90", "bursts-70", "long-tail-70", "mooncake-70"],
)
def test_a_peers_spec_is_its_family_spec_with_and_without_peer_polls(family: str) -> None:
    """The several-proxies runs (docs/fleet-benchmark.md "Several proxies") send the family
    spec's requests to the default at 1 x 1 and 4 x 2, with and without proxy.peers."""
    base = load_spec(SPECS / f"{family}.toml")
    variant = load_spec(SPECS / "sensitivity" / f"peers-{family}.toml")
    _assert_same_requests(base, variant)
    assert variant.routers == ("fastroute", "default-4x2", "default-4x2-alone")
    shared, alone = (variant.fastroute_variants[n] for n in variant.routers[1:])
    assert (shared.workers, shared.proxies, shared.peers) == (4, 2, True)
    assert (alone.workers, alone.proxies, alone.peers) == (4, 2, False)


_WITHOUT = {
    "keylog": ("default-4x2-nolog", {"key_log_entries": 0}),
    "exchange": ("default-4x2-noexchange", {"peer_key_exchange": False}),
    "poll": ("default-4x2-poll025", {"peer_poll_interval_s": 0.25}),
}


@pytest.mark.parametrize(
    ("sharing", "family"),
    [
        ("keylog", "bursts-70"),
        ("keylog", "bursts-90"),
        ("keylog", "prefix-tree-90"),
        ("exchange", "bursts-90"),
        ("exchange", "prefix-tree-90"),
        ("poll", "bursts-90"),
        ("poll", "prefix-tree-90"),
    ],
)
def test_a_sharing_spec_is_its_family_spec_with_and_without_the_sharing(
    sharing: str, family: str
) -> None:
    """The several-workers runs (docs/fleet-benchmark.md "Several workers") send the family
    spec's requests to the default at 1 x 1 and 4 x 2, with and without the key log (or
    the key exchange between the proxies, or at the poll period before 2026-12-06)."""
    base = load_spec(SPECS / f"{family}.toml")
    variant = load_spec(SPECS / "sensitivity" / f"{sharing}-{family}.toml")
    _assert_same_requests(base, variant)
    without, setting = _WITHOUT[sharing]
    assert variant.routers == ("fastroute", "default-4x2", without)
    shared, alone = (variant.fastroute_variants[n] for n in variant.routers[1:])
    assert (shared.workers, shared.proxies, shared.peers, shared.proxy) == (4, 2, True, {})
    assert (alone.workers, alone.proxies, alone.peers) == (4, 2, True)
    assert alone.proxy == setting


@pytest.mark.parametrize("family", ["bursts-90", "prefix-tree-90"])
def test_a_keylog_4x1_spec_is_its_family_spec_at_four_workers_with_and_without(
    family: str,
) -> None:
    """The one-proxy runs of "Several workers": 4 workers, the key log on and off."""
    base = load_spec(SPECS / f"{family}.toml")
    variant = load_spec(SPECS / "sensitivity" / f"keylog-4x1-{family}.toml")
    _assert_same_requests(base, variant)
    assert variant.routers == ("default-4x1", "default-4x1-nolog")
    shared, alone = (variant.fastroute_variants[n] for n in variant.routers)
    assert (shared.workers, shared.proxies, shared.proxy) == (4, 1, {})
    assert (alone.workers, alone.proxies, alone.proxy) == (4, 1, {"key_log_entries": 0})


@pytest.mark.parametrize("family", ["bursts-90", "prefix-tree-90"])
def test_a_stall_spec_is_its_family_spec_with_and_without_the_stall_price(family: str) -> None:
    """The stall runs (docs/fleet-benchmark.md "Beyond the nominal loads") send the family
    spec's requests to the default and to the default without the re-prefill's stall."""
    base = load_spec(SPECS / f"{family}.toml")
    variant = load_spec(SPECS / "sensitivity" / f"stall-{family}.toml")
    _assert_same_requests(base, variant)
    assert variant.routers == ("fastroute", "stall0")
    without = variant.fastroute_variants["stall0"]
    assert (without.policy, without.params) == ("prefix-hrw", {"stall_weight": 0.0})


def test_the_prefix_bytes_spec_is_agentic_90_at_32_and_128_kb() -> None:
    """The prefix_bytes runs (docs/fleet-benchmark.md "The TTFT p99 misses, request by
    request") send agentic-90's requests to the default at 32 kB (its default) and 128 kB."""
    base = load_spec(SPECS / "agentic-90.toml")
    variant = load_spec(SPECS / "sensitivity" / "prefix-bytes-agentic-90.toml")
    _assert_same_requests(base, variant)
    assert variant.routers == ("pb32", "pb128")
    runs = [variant.fastroute_variants[n] for n in variant.routers]
    assert [(v.policy, v.params) for v in runs] == [
        ("prefix-hrw", {"prefix_bytes": 32768}),
        ("prefix-hrw", {"prefix_bytes": 131072}),
    ]


@pytest.mark.parametrize(
    ("family", "name", "load"), [("rag", "rag-400", 4.0), ("bursts", "bursts-250", 2.5)]
)
def test_a_saturation_stall_spec_is_its_family_spec_at_a_higher_load(
    family: str, name: str, load: float
) -> None:
    """The saturation runs send the 90 % spec's family, fleet, seed and SLOs at ``load``."""
    base = load_spec(SPECS / f"{family}-90.toml")
    variant = load_spec(SPECS / "sensitivity" / f"stall-{name}.toml")
    assert (variant.family, variant.fleet, variant.seed, variant.slo) == (
        base.family,
        base.fleet,
        base.seed,
        base.slo,
    )
    assert variant.load == load
    assert variant.routers == ("fastroute", "stall0", "fastroute:cache-aware")
    assert variant.fastroute_variants["stall0"].params == {"stall_weight": 0.0}
