"""The engines state file and the one merge of config, state-file and discovered engines."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest

from fastroute.config import ConfigError, EngineConfig, decode_config, decode_engine
from fastroute.discovery.merge import discovered_engine, load_effective_config, merge_fleet
from fastroute.discovery.state_file import (
    Address,
    DiscoveryStatus,
    EngineState,
    read_state,
    state_path_of,
    update_state,
)

CONFIG = """
[[engines]]
name = "static"
url = "http://127.0.0.1:9000"
models = ["m"]

[[discovery]]
name = "pool"
dns_name = "pool.test"
port = 8000
models = ["m"]
hardware = "h100"
"""


def admin_engine(name: str = "added", port: int = 9100) -> EngineConfig:
    return decode_engine({"name": name, "url": f"http://127.0.0.1:{port}", "models": ["m"]})


def test_merge_orders_sources_marks_draining_and_validates() -> None:
    config = decode_config(CONFIG)
    state = EngineState(
        engines=(admin_engine(),),
        draining=frozenset({"static"}),
        discovery={"pool": DiscoveryStatus(addresses=(Address("10.0.0.1", 8000),))},
    )
    merged = merge_fleet(config, state)
    assert [(e.engine.name, e.source, e.draining) for e in merged.entries] == [
        ("static", "config", True),
        ("added", "admin", False),
        ("pool/10.0.0.1:8000", "dns", False),
    ]
    assert [e.name for e in merged.config.engines] == ["added", "pool/10.0.0.1:8000"]
    pool = merged.config.engine("pool/10.0.0.1:8000")
    assert pool.hardware == "h100" and pool.zone is not None  # zone filled in by validation


def test_merge_config_wins_name_clashes_and_dns_skips_known_addresses() -> None:
    config = decode_config(CONFIG)
    clash = admin_engine("static", 9200)
    state = EngineState(
        engines=(clash,),
        discovery={"pool": DiscoveryStatus(addresses=(Address("127.0.0.1", 9000),))},
    )
    merged = merge_fleet(config, state)
    assert [(e.engine.name, e.engine.url) for e in merged.entries] == [
        ("static", "http://127.0.0.1:9000")
    ]


def test_merge_refuses_a_fleet_the_validator_refuses() -> None:
    config = decode_config(CONFIG)
    with pytest.raises(ConfigError, match="unique engine address"):
        merge_fleet(config, EngineState(engines=(admin_engine("a", 9000),)))
    with pytest.raises(ConfigError, match="draining"):
        merge_fleet(config, EngineState(draining=frozenset({"static"})))
    with pytest.raises(ConfigError, match="region"):
        merge_fleet(
            config, EngineState(engines=(msgspec.structs.replace(admin_engine(), region="mars"),))
        )


def test_discovered_engine_names_ipv6_urls_and_long_names() -> None:
    disc = decode_config(CONFIG).discovery[0]
    v6 = discovered_engine(disc, Address("fd00::1", 8000))
    assert v6.name == "pool/fd00::1:8000" and v6.url == "http://[fd00::1]:8000"
    long = discovered_engine(disc, Address("a" * 200 + ".svc", 8000))
    assert len(long.name) == 128 and long.name.startswith("pool/aaa")
    other = discovered_engine(disc, Address("a" * 200 + ".svd", 8000))
    assert other.name != long.name


def test_state_file_round_trip_atomic_and_locked(tmp_path: Path) -> None:
    path = tmp_path / "f.toml.engines.json"
    assert read_state(path) == EngineState()
    state = EngineState(
        engines=(admin_engine(),),
        draining=frozenset({"x"}),
        discovery={"pool": DiscoveryStatus((Address("10.0.0.1", 1),), 2, "boom", 5.0)},
    )
    new, written = update_state(path, lambda _: state)
    assert written and new == state and read_state(path) == state
    assert update_state(path, lambda s: s) == (state, False)  # unchanged: not written
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, path.name + ".lock"]

    # Concurrent writers (threads of one process each take the flock on its own fd).
    def add(i: int) -> None:
        update_state(path, lambda s: replace(s, draining=s.draining | {f"e{i}"}))

    threads = [threading.Thread(target=add, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert read_state(path).draining == {"x", *(f"e{i}" for i in range(8))}


def test_invalid_state_file_is_a_config_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "f.toml.engines.json"
    path.write_text('{"version": 1, "engines": [{"name": "x"}]}')
    with pytest.raises(ConfigError, match=r"engines.json.*\$\.engines\[0\]"):
        read_state(path)
    path.write_text('{"version": 7}')
    with pytest.raises(ConfigError, match="version"):
        read_state(path)
    path.write_text("not json")
    with pytest.raises(ConfigError, match="invalid engines state file"):
        read_state(path)


def test_load_effective_config_reads_the_state_file_next_to_the_config(tmp_path: Path) -> None:
    config = tmp_path / "f.toml"
    config.write_text(CONFIG)
    assert state_path_of(config) == tmp_path / "f.toml.engines.json"
    update_state(state_path_of(config), lambda s: replace(s, engines=(admin_engine(),)))
    assert [e.name for e in load_effective_config(config).engines] == ["static", "added"]


def test_discovery_section_rules() -> None:
    with pytest.raises(ConfigError, match="port"):
        decode_config(CONFIG.replace("port = 8000\n", ""))
    with pytest.raises(ConfigError, match="interval_s"):
        decode_config(CONFIG + "timeout_s = 20.0\n")
    with pytest.raises(ConfigError, match="hardware"):
        decode_config(CONFIG.replace('"h100"', '"h999"'))
    srv = CONFIG.replace("port = 8000\n", 'record = "SRV"\n')
    assert decode_config(srv).discovery[0].record == "SRV"
