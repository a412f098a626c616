"""The configuration layer: TOML → frozen msgspec Structs, errors with paths, generated docs."""

from __future__ import annotations

import argparse
import pickle
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from fastroute.config import (
    DEFAULT_HARDWARE_CLASSES,
    POLICY_NAMES,
    PRIORITIES,
    ClassConfig,
    Config,
    ConfigError,
    DeratingConfig,
    EngineConfig,
    ProxyConfig,
    decode_config,
    hash_api_key,
    load_config,
    render_markdown,
    validate_config,
)
from fastroute.errors import FastrouteError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "fastroute.toml"
DOCS = ROOT / "docs" / "configuration.md"

#: The smallest valid file: everything else has a default.
MINIMAL = """
[[engines]]
name = "e0"
url = "http://127.0.0.1:9100"
models = ["m"]
"""

TWO_ENGINES = """
[[engines]]
name = "e0"
url = "http://127.0.0.1:9100"
models = ["m"]

[[engines]]
name = "e1"
url = "http://127.0.0.1:9101"
models = ["m"]
"""

TWO_REGIONS = """
[[network.regions]]
name = "us"
zone = "us-zone"

[[network.regions]]
name = "eu"
zone = "eu-zone"

[network.rtt_ms]
us = { eu = 80.0 }

[proxy]
cluster = "us"

[[engines]]
name = "e0"
url = "http://127.0.0.1:9100"
models = ["m"]
region = "us"

[[engines]]
name = "e1"
url = "http://127.0.0.1:9101"
models = ["m"]
region = "eu"
"""


def _error(text: str, source: str = "<string>") -> ConfigError:
    with pytest.raises(ConfigError) as info:
        decode_config(text, source=source)
    return info.value


# --------------------------------------------------------------------------------------------
# The shipped example


def test_example_file_loads() -> None:
    """examples/fastroute.toml is valid as shipped and has the documented shape."""
    config = load_config(EXAMPLE)
    assert [e.name for e in config.engines] == [f"engine-{i}" for i in range(4)]
    assert [e.url for e in config.engines] == [f"http://127.0.0.1:{9100 + i}" for i in range(4)]
    assert all(e.models == ("demo-8b",) for e in config.engines)
    assert (config.proxy.host, config.proxy.port) == ("127.0.0.1", 8080)
    assert (config.controller.host, config.controller.port) == ("127.0.0.1", 8090)
    assert config.proxy.cluster in {r.name for r in config.network.regions}
    assert len(config.tenants) == 1 and config.proxy.default_tenant == config.tenants[0].name
    assert config.class_for("demo-8b", "default").name == "demo-default"


def test_example_matches_what_the_engine_command_starts() -> None:
    """The example's engines match `fastroute engine --count 4 --base-port 9100 --model demo-8b`."""
    from fastroute.emulator import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--count", "4", "--base-port", "9100", "--model", "demo-8b"])
    specs = cli._specs(args)
    config = load_config(EXAMPLE)
    started = [
        (s.name, f"http://{s.host}:{s.port}", s.model_name, s.profile, s.role) for s in specs
    ]
    configured = [(e.name, e.url, e.models[0], e.hardware, e.role) for e in config.engines]
    assert configured == started


def test_example_engine_zones_are_resolved_from_regions() -> None:
    """Engines without an explicit zone get their region's zone after loading."""
    config = load_config(EXAMPLE)
    zone_of = {r.name: r.zone for r in config.network.regions}
    assert all(e.zone == zone_of[e.region] for e in config.engines)


# --------------------------------------------------------------------------------------------
# Defaults


def test_minimal_file_gets_the_documented_defaults() -> None:
    """A file with one engine is complete: every other key takes its documented default."""
    config = decode_config(MINIMAL)
    engine = config.engines[0]
    assert (engine.region, engine.zone, engine.hardware, engine.role) == (
        "local",
        "default",
        "a40",
        "both",
    )
    assert engine.capacity_rps == 10.0 and engine.max_concurrency is None
    assert [r.name for r in config.network.regions] == ["local"]
    assert (config.proxy.host, config.proxy.port, config.proxy.cluster) == (
        "127.0.0.1",
        8080,
        "local",
    )
    assert config.proxy.session_header == "x-session-id"
    assert config.proxy.forward_authorization is False and config.proxy.admin_token is None
    assert config.proxy.report_interval_s == 1.0 and config.proxy.scrape_engines is False
    assert (config.controller.host, config.controller.port) == ("127.0.0.1", 8090)
    assert config.policy.default == "prefix-hrw"
    assert (config.policy.top_k, config.policy.bounded_load_factor) == (3, 2.0)
    assert (config.retry.ratio, config.retry.ttl_s, config.retry.max_retries) == (0.1, 10.0, 1)
    assert config.ejection.consecutive_failures == 5
    assert config.ejection.max_ejected_fraction == 0.5
    penalties = config.controller.shed_penalties
    assert (penalties.batch, penalties.default, penalties.interactive) == (1.0, 10.0, 100.0)
    assert config.controller.breakpoints == (0.30, 0.50, 0.65, 0.75, 0.83, 0.89, 0.93, 0.95)
    assert config.tenants == () and config.classes == ()


def test_default_hardware_classes_are_the_builtin_profiles() -> None:
    """The default hardware labels are the built-in datasheet profiles, GPUs first (Llama-3-8B),
    then the Qwen2.5-3B variants, and a config without ``hardware_classes`` accepts each."""
    assert DEFAULT_HARDWARE_CLASSES == (
        *("h100", "a100", "a40", "l4"),
        *("h100-qwen2.5-3b", "a100-qwen2.5-3b", "a40-qwen2.5-3b", "l4-qwen2.5-3b"),
    )
    for label in DEFAULT_HARDWARE_CLASSES:
        config = decode_config(
            MINIMAL.replace('models = ["m"]', f'models = ["m"]\nhardware = "{label}"')
        )
        assert config.engines[0].hardware == label


def test_vocabularies_match_the_design() -> None:
    """Priorities are ordered lowest first; the policy names are the seven of docs/design.md §6,
    experiment (h)'s length-heuristic baseline and the prefix-depth default."""
    assert PRIORITIES == ("batch", "default", "interactive")
    assert set(POLICY_NAMES) == {
        "prefix-hrw",
        "weighted-hrw",
        "round-robin",
        "least-request",
        "power-of-two",
        "consistent-hash",
        "cache-aware",
        "marginal-cost",
        "length-heuristic",
    }


# --------------------------------------------------------------------------------------------
# Bad input: every error names the source and the JSON path

BAD_INPUTS = [
    pytest.param(
        TWO_ENGINES.replace('"http://127.0.0.1:9101"', '"http://127.0.0.1"'),
        "$.engines[1].url",
        "expected an explicit port",
        id="url-without-port",
    ),
    pytest.param(
        TWO_ENGINES.replace('"http://127.0.0.1:9101"', '"ftp://127.0.0.1:9101"'),
        "$.engines[1].url",
        "expected http://host:port or https://host:port",
        id="url-bad-scheme",
    ),
    pytest.param(
        TWO_ENGINES.replace('"http://127.0.0.1:9101"', '"http://127.0.0.1:9101/v1"'),
        "$.engines[1].url",
        "with no path",
        id="url-with-path",
    ),
    pytest.param(
        TWO_ENGINES.replace('"http://127.0.0.1:9101"', '"http://127.0.0.1:99999"'),
        "$.engines[1].url",
        "out of range",
        id="url-port-out-of-range",
    ),
    pytest.param(
        TWO_ENGINES.replace('"http://127.0.0.1:9101"', '"http://127.0.0.1:9100"'),
        "$.engines[1].url",
        "expected a unique engine address",
        id="url-duplicate",
    ),
    pytest.param(
        TWO_ENGINES.replace('"http://127.0.0.1:9101"', '"http://127.0.0.1:8080"'),
        "$.engines[1].url",
        "the proxy's own listen address",
        id="url-is-the-proxy",
    ),
    pytest.param(
        MINIMAL + "\n[proxy]\nprot = 8080\n",
        "$.proxy",
        "unknown field `prot`; did you mean `port`?",
        id="unknown-field",
    ),
    pytest.param(
        "colour = 'blue'\n" + MINIMAL,
        "$",
        "unknown field `colour`",
        id="unknown-root-field",
    ),
    pytest.param(
        MINIMAL + '\n[timeouts]\nconnect_timeout_s = "2s"\n',
        "$.timeouts.connect_timeout_s",
        "Expected `float`, got `str`",
        id="wrong-type",
    ),
    pytest.param(
        MINIMAL + "\n[timeouts]\nidle_timeout_s = -1.0\n",
        "$.timeouts.idle_timeout_s",
        "Expected `float` > 0",
        id="negative-timeout",
    ),
    pytest.param(
        MINIMAL + "\n[timeouts]\nconnect_timeout_s = 700.0\n",
        "$.timeouts.connect_timeout_s",
        "expected at most total_timeout_s",
        id="timeout-above-total",
    ),
    pytest.param(
        MINIMAL + "\n[retry]\nmax_retries = 3\n",
        "$.retry.max_retries",
        "Expected `int` <= 1",
        id="too-many-retries",
    ),
    pytest.param(
        MINIMAL + "\n[policy]\nbounded_load_factor = 0.5\n",
        "$.policy.bounded_load_factor",
        ">= 1.0",
        id="bounded-load-below-one",
    ),
    pytest.param(
        MINIMAL + '\n[policy]\ndefault = "random"\n',
        "$.policy.default",
        "expected one of 'prefix-hrw', 'weighted-hrw'",
        id="unknown-policy",
    ),
    pytest.param(
        MINIMAL.replace('models = ["m"]', 'models = ["m"]\nrole = "verifier"'),
        "$.engines[0].role",
        "expected one of 'both', 'prefill', 'decode'",
        id="unknown-role",
    ),
    pytest.param(
        TWO_ENGINES.replace('name = "e1"', 'name = "e0"'),
        "$.engines[1].name",
        "duplicate engine name 'e0'",
        id="duplicate-engine-name",
    ),
    pytest.param(
        MINIMAL.replace('models = ["m"]', 'models = ["m"]\nregion = "mars"'),
        "$.engines[0].region",
        "expected a declared region, one of ['local'], got 'mars'",
        id="unknown-region",
    ),
    pytest.param(
        MINIMAL.replace('models = ["m"]', 'models = ["m"]\nzone = "moon"'),
        "$.engines[0].zone",
        "got 'moon'",
        id="unknown-zone",
    ),
    pytest.param(
        MINIMAL.replace('models = ["m"]', 'models = ["m"]\nhardware = "a4O"'),
        "$.engines[0].hardware",
        "expected a declared hardware class",
        id="unknown-hardware",
    ),
    pytest.param(
        MINIMAL.replace('models = ["m"]', 'models = ["m"]\nrole = "prefill"'),
        "$.engines[0].role",
        "no 'decode' or 'both' engine",
        id="prefill-without-decode",
    ),
    pytest.param(
        MINIMAL.replace('models = ["m"]', "models = []"),
        "$.engines[0].models",
        "length >= 1",
        id="no-models",
    ),
    pytest.param(
        "[proxy]\nport = 8081\n",
        "$",
        "missing required field `engines`",
        id="no-engines",
    ),
    pytest.param(
        TWO_REGIONS.replace("[network.rtt_ms]\nus = { eu = 80.0 }\n", ""),
        "$.network.rtt_ms",
        "expected an RTT between regions 'us' and 'eu'",
        id="rtt-matrix-incomplete",
    ),
    pytest.param(
        TWO_REGIONS.replace("us = { eu = 80.0 }", "us = { eu = 80.0, asia = 120.0 }"),
        "$.network.rtt_ms.us.asia",
        "expected a declared region",
        id="rtt-unknown-region",
    ),
    pytest.param(
        TWO_REGIONS.replace("us = { eu = 80.0 }", "us = { eu = -1.0 }"),
        "$.network.rtt_ms.us.eu",
        "expected a finite RTT >= 0 ms",
        id="rtt-negative",
    ),
    pytest.param(
        TWO_REGIONS.replace("us = { eu = 80.0 }", "us = { eu = nan }"),
        "$.network.rtt_ms.us.eu",
        "expected a finite RTT >= 0 ms",
        id="rtt-nan",
    ),
    pytest.param(
        TWO_REGIONS.replace('cluster = "us"', 'cluster = "asia"'),
        "$.proxy.cluster",
        "expected a declared region",
        id="proxy-cluster-unknown",
    ),
    pytest.param(
        MINIMAL + "\n[controller]\nbreakpoints = [0.3, 0.5, 0.5, 0.9]\n",
        "$.controller.breakpoints[2]",
        "expected strictly increasing breakpoints",
        id="breakpoints-not-increasing",
    ),
    pytest.param(
        MINIMAL + "\n[controller]\nbreakpoints = [0.5, 1.0]\n",
        "$.controller.breakpoints[1]",
        "expected a utilisation in (0, 1)",
        id="breakpoints-reach-one",
    ),
    pytest.param(
        MINIMAL + "\n[controller]\nbreakpoints = [0.0, 0.5]\n",
        "$.controller.breakpoints[0]",
        "expected a utilisation in (0, 1)",
        id="breakpoints-include-zero",
    ),
    pytest.param(
        MINIMAL + "\n[controller]\nbreakpoints = []\n",
        "$.controller.breakpoints",
        "length >= 1",
        id="breakpoints-empty",
    ),
    pytest.param(
        MINIMAL + "\n[controller.shed_penalties]\ninteractive = 5.0\n",
        "$.controller.shed_penalties.interactive",
        "expected at least default",
        id="shed-penalties-out-of-order",
    ),
    pytest.param(
        MINIMAL + "\n[controller]\nport = 8080\n",
        "$.controller.port",
        "expected a port other than the proxy's 8080",
        id="controller-port-clash",
    ),
    pytest.param(
        MINIMAL + "\n[controller]\nperiod_s = 1.0\nsolve_time_limit_s = 2.0\n",
        "$.controller.solve_time_limit_s",
        "expected less than period_s",
        id="solve-limit-above-period",
    ),
    pytest.param(
        MINIMAL + "\n[ejection]\nbase_ejection_s = 60.0\nmax_ejection_s = 30.0\n",
        "$.ejection.max_ejection_s",
        "expected at least base_ejection_s",
        id="ejection-cap-below-base",
    ),
    pytest.param(
        MINIMAL + '\n[[tenants]]\nname = "t"\nzones = ["eu"]\n',
        "$.tenants[0].zones[0]",
        "expected a declared zone",
        id="tenant-zone-unknown",
    ),
    pytest.param(
        MINIMAL + '\n[[tenants]]\nname = "t"\nhardware = "h100"\n',
        "$.tenants[0].hardware",
        "no engine of hardware 'h100'",
        id="tenant-hardware-without-engines",
    ),
    pytest.param(
        MINIMAL + '\n[[tenants]]\nname = "t"\napi_key_sha256 = ["ABC"]\n',
        "$.tenants[0].api_key_sha256[0]",
        "Expected `str` matching regex",
        id="tenant-bad-key-hash",
    ),
    pytest.param(
        MINIMAL
        + '\n[[tenants]]\nname = "a"\napi_keys = ["sk-1"]\n'
        + f'\n[[tenants]]\nname = "b"\napi_key_sha256 = ["{hash_api_key("sk-1")}"]\n',
        "$.tenants[1].api_key_sha256[0]",
        "already tenant 'a'",
        id="api-key-shared-by-tenants",
    ),
    pytest.param(
        MINIMAL + '\n[proxy]\ndefault_tenant = "nobody"\n',
        "$.proxy.default_tenant",
        "expected a declared tenant",
        id="default-tenant-unknown",
    ),
    pytest.param(
        MINIMAL + '\n[[classes]]\nname = "c"\nmodel = "llama-70b"\n',
        "$.classes[0].model",
        "expected a declared model (served by some engine)",
        id="class-model-not-served",
    ),
    pytest.param(
        MINIMAL
        + '\n[[classes]]\nname = "c"\nmodel = "m"\n\n[[classes]]\nname = "d"\nmodel = "m"\n',
        "$.classes[1].priority",
        "expected one class per (model, priority)",
        id="class-duplicate-model-priority",
    ),
    pytest.param(
        MINIMAL + '\n[[classes]]\nname = "c"\nmodel = "m"\npriority = "urgent"\n',
        "$.classes[0].priority",
        "expected one of 'batch', 'default', 'interactive'",
        id="class-unknown-priority",
    ),
    pytest.param(
        MINIMAL + "\n[policy.params.cache-awre]\ncache_threshold = 0.5\n",
        "$.policy.params.cache-awre",
        "expected a declared policy name",
        id="policy-params-unknown-policy",
    ),
    pytest.param(
        MINIMAL + "\n[policy.params.cache-aware]\ncache_threshold = [0.5]\n",
        "$.policy.params[...][...]",
        "Expected `bool | int | float | str`, got `array`",
        id="policy-params-bad-value",
    ),
    pytest.param(
        MINIMAL + '\n[proxy]\ncontroller_url = "10.0.0.5:8090"\n',
        "$.proxy.controller_url",
        "expected http://host:port",
        id="controller-url-without-scheme",
    ),
]


@pytest.mark.parametrize(("text", "path", "fragment"), BAD_INPUTS)
def test_bad_input_names_the_path(text: str, path: str, fragment: str) -> None:
    """Each kind of bad value is a ConfigError naming the source, the JSON path and the cause."""
    error = _error(text, source="fleet.toml")
    assert error.path == path
    message = str(error)
    assert message.startswith("fleet.toml: ")
    assert f"- at `{path}`" in message
    assert fragment in message


def test_all_cross_field_problems_are_reported_together() -> None:
    """Cross-field checks report every problem in one error, in document order."""
    text = TWO_ENGINES.replace('name = "e1"', 'name = "e0"').replace(
        '"http://127.0.0.1:9101"', '"http://127.0.0.1"'
    )
    text += "\n[controller]\nbreakpoints = [0.9, 0.5]\n"
    error = _error(text)
    assert [path for path, _ in error.problems] == [
        "$.engines[1].name",
        "$.engines[1].url",
        "$.controller.breakpoints[1]",
    ]
    assert str(error).startswith("<string>: 3 problems:\n")


def test_toml_syntax_error_gives_the_line() -> None:
    """A TOML syntax error is a ConfigError with the line number, not a tomllib exception."""
    text = '[proxy]\nhost = "127.0.0.1"\nport = = 8080\n' + MINIMAL
    error = _error(text, source="fleet.toml")
    assert error.lineno == 3
    assert error.path is None
    assert str(error).startswith("fleet.toml: invalid TOML: ")
    assert "line 3" in str(error)


def test_load_config_names_the_file(tmp_path: Path) -> None:
    """Errors from load_config carry the file's path; a missing file is a ConfigError too."""
    path = tmp_path / "fastroute.toml"
    path.write_text(MINIMAL + "\n[limits]\nmax_body_bytes = 10\n")
    with pytest.raises(ConfigError, match=r"fastroute\.toml: .* - at `\$\.limits\.max_body_bytes`"):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot read config file") as info:
        load_config(tmp_path / "absent.toml")
    assert str(tmp_path / "absent.toml") in str(info.value)


def test_non_utf8_bytes_are_a_config_error() -> None:
    """Bytes that are not UTF-8 fail as a ConfigError, not a UnicodeDecodeError."""
    with pytest.raises(ConfigError, match="expected UTF-8"):
        decode_config(b"\xff\xfe[proxy]\n")


def test_config_error_is_a_value_error_and_pickles() -> None:
    """ConfigError fits the hierarchy and survives pickling (worker processes report it)."""
    error = _error(TWO_ENGINES.replace('name = "e1"', 'name = "e0"'), source="f.toml")
    assert isinstance(error, FastrouteError) and isinstance(error, ValueError)
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.path, copy.problems) == (str(error), error.path, error.problems)


# --------------------------------------------------------------------------------------------
# Behaviour of the decoded tree


def test_example_policy_params_are_accepted_by_the_policies() -> None:
    """The example's per-policy tunables build real policies (names and types line up)."""
    from fastroute.policy.registry import make_policy

    config = load_config(EXAMPLE)
    assert config.policy.params, "the example should show policy tunables"
    for name, params in config.policy.params.items():
        make_policy(name, **params)


def test_config_is_frozen() -> None:
    """Config Structs cannot be mutated, at the root or nested, and sequences are tuples."""
    config = decode_config(MINIMAL)
    with pytest.raises(AttributeError):
        config.proxy = config.proxy  # type: ignore[misc]
    with pytest.raises(AttributeError):
        config.proxy.port = 9000  # type: ignore[misc]
    with pytest.raises(AttributeError):
        config.engines[0].url = "http://127.0.0.1:1"  # type: ignore[misc]
    assert isinstance(config.engines, tuple) and isinstance(config.engines[0].models, tuple)


def test_rtt_matrix_defaults() -> None:
    """A missing direction mirrors the given one, a missing diagonal is 0, explicit wins."""
    config = decode_config(TWO_REGIONS)
    assert config.network.rtt_matrix_ms() == ((0.0, 80.0), (80.0, 0.0))
    asymmetric = TWO_REGIONS.replace("us = { eu = 80.0 }", "us = { eu = 80.0, us = 0.5 }")
    asymmetric += "\n[network.rtt_ms.eu]\nus = 90.0\n"
    config = decode_config(asymmetric)
    assert config.network.rtt_matrix_ms() == ((0.5, 80.0), (90.0, 0.0))
    assert [e.zone for e in config.engines] == ["us-zone", "eu-zone"]


def test_class_for_prefers_exact_then_wildcard_then_defaults() -> None:
    """Class lookup: (model, priority) match, then the `*` class, then default SLOs."""
    text = (
        MINIMAL
        + '\n[[classes]]\nname = "any-batch"\nmodel = "*"\npriority = "batch"\nttft_slo_s = 30.0\n'
        + '\n[[classes]]\nname = "m-batch"\nmodel = "m"\npriority = "batch"\n'
        + 'policy = "round-robin"\n'
    )
    config = decode_config(text)
    assert config.class_for("m", "batch").name == "m-batch"
    assert config.policy_for(config.class_for("m", "batch")) == "round-robin"
    assert config.class_for("other", "batch").name == "any-batch"
    fallback = config.class_for("m", "interactive")
    assert fallback == ClassConfig(name="m/interactive", model="m", priority="interactive")
    assert config.policy_for(fallback) == "prefix-hrw"
    with pytest.raises(ValueError, match="priority must be one of"):
        config.class_for("m", "urgent")


def test_hashed_api_keys_are_accepted() -> None:
    """hash_api_key produces what api_key_sha256 accepts, and it is plain SHA-256 hex."""
    # FIPS 180-2 test vector for "abc".
    assert hash_api_key("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    digest = hash_api_key("sk-test")
    config = decode_config(MINIMAL + f'\n[[tenants]]\nname = "t"\napi_key_sha256 = ["{digest}"]\n')
    assert config.tenants[0].api_key_sha256 == (digest,)


def test_round_trip_through_builtins() -> None:
    """A loaded config encodes to plain data and decodes back to an equal config."""
    config = load_config(EXAMPLE)
    again = validate_config(msgspec.convert(msgspec.to_builtins(config), Config))
    assert again == config


def test_validate_config_checks_hand_built_structs() -> None:
    """validate_config applies the cross-field rules to Structs built in Python."""
    engine = EngineConfig(name="e", url="http://127.0.0.1:9100", models=("m",), region="nowhere")
    with pytest.raises(ConfigError, match=r"- at `\$\.engines\[0\]\.region`"):
        validate_config(Config(engines=(engine,)))


# --------------------------------------------------------------------------------------------
# Generated documentation


def test_docs_are_up_to_date() -> None:
    """docs/configuration.md equals render_markdown() (regenerate: `python -m fastroute.config`)."""
    assert DOCS.read_text() == render_markdown(), (
        "docs/configuration.md is stale: run `.venv/bin/python -m fastroute.config > "
        "docs/configuration.md`"
    )


def test_docs_list_every_field_of_every_section() -> None:
    """Each Struct field appears as a row of its section's table."""
    text = render_markdown()
    for header, struct in [
        ("`[[engines]]`", EngineConfig),
        ("`[proxy]`", ProxyConfig),
        ("`[controller.derating]`", DeratingConfig),
    ]:
        section = text.split(f"## {header}", 1)[1].split("\n## ", 1)[0]
        for field in msgspec.structs.fields(struct):
            assert f"| `{field.encode_name}` |" in section, (header, field.name)


def test_module_cli_prints_docs_and_checks_files(tmp_path: Path) -> None:
    """`python -m fastroute.config` prints the docs; with a FILE it validates it (exit 0/1)."""
    run = [sys.executable, "-m", "fastroute.config"]
    printed = subprocess.run(run, capture_output=True, text=True, check=True, cwd=ROOT)
    assert printed.stdout == render_markdown()
    ok = subprocess.run([*run, str(EXAMPLE)], capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0 and "ok (4 engines" in ok.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text(MINIMAL.replace(":9100", ""))
    failed = subprocess.run([*run, str(bad)], capture_output=True, text=True, cwd=ROOT)
    assert failed.returncode == 1 and "- at `$.engines[0].url`" in failed.stderr


# --------------------------------------------------------------------------------------------
# [controller.ha]


def test_controller_ha_is_off_by_default_and_validated() -> None:
    assert decode_config(MINIMAL).controller.ha.etcd_urls == ()
    ok = decode_config(
        MINIMAL + '[controller.ha]\netcd_urls = ["http://127.0.0.1:2379"]\nlease_ttl_s = 2\n'
        "etcd_timeout_s = 0.4\n"
    )
    assert ok.controller.ha.lease_ttl_s == 2
    assert "http://" in str(_error(MINIMAL + '[controller.ha]\netcd_urls = ["etcd1:2379"]\n'))
    slow = _error(MINIMAL + '[controller.ha]\netcd_urls = ["http://e:2379"]\nlease_ttl_s = 2\n')
    assert "lease_ttl_s / 3" in str(slow)  # the default 1 s timeout cannot fit a 2/3 s renewal
    bad = _error(MINIMAL + '[proxy]\ncontroller_fallback_urls = ["ctl2:8090"]\n')
    assert "controller_fallback_urls[0]" in str(bad)


def test_proxy_peers_are_server_roots_listed_once() -> None:
    assert decode_config(MINIMAL).proxy.peers == ()
    assert decode_config(MINIMAL).proxy.peer_poll_interval_s == 0.05
    ok = decode_config(MINIMAL + '[proxy]\npeers = ["http://10.0.0.2:8080"]\n')
    assert ok.proxy.peers == ("http://10.0.0.2:8080",)
    bad = _error(MINIMAL + '[proxy]\npeers = ["http://10.0.0.2:8080", "10.0.0.3:8080"]\n')
    assert "$.proxy.peers[1]" in str(bad) and "http://host:port" in str(bad)
    twice = _error(MINIMAL + '[proxy]\npeers = ["http://p:8080", "http://p:8080/"]\n')
    assert "$.proxy.peers[1]" in str(twice) and "repeats" in str(twice)
    fast = _error(MINIMAL + "[proxy]\npeer_poll_interval_s = 0.001\n")
    assert "peer_poll_interval_s" in str(fast)
