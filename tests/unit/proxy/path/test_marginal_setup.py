"""install_marginal: one policy instance for whole requests and both P/D pools,
calibration kept across reloads, /metrics families only with marginal-cost."""

from __future__ import annotations

from fastroute.config import decode_config
from fastroute.policy.marginal import MarginalCost, MarginalPairs
from fastroute.proxy.proxy_app import build_context

_ENGINES = (
    '[[engines]]\nname = "c0"\nurl = "http://127.0.0.1:9000"\nmodels = ["m"]\n\n'
    '[[engines]]\nname = "p0"\nurl = "http://127.0.0.1:9001"\nmodels = ["pd"]\nrole = "prefill"\n\n'
    '[[engines]]\nname = "d0"\nurl = "http://127.0.0.1:9002"\nmodels = ["pd"]\nrole = "decode"\n\n'
)
MARGINAL = _ENGINES + '[policy]\ndefault = "marginal-cost"\n'


def test_one_instance_everywhere_and_pairs_for_pd() -> None:
    ctx = build_context(decode_config(MARGINAL), None, None)
    policy = ctx.policies["marginal-cost"]
    assert isinstance(policy, MarginalCost)
    assert ctx.pd is not None
    assert ctx.pd.prefill_policies["marginal-cost"] is policy
    assert ctx.pd.decode_policies["marginal-cost"] is policy
    selector = ctx.pd.selector("marginal-cost")
    assert isinstance(selector, MarginalPairs) and selector.policy is policy
    for fleet in (ctx.fleet, ctx.pd.prefill, ctx.pd.decode):
        assert fleet.load is not None and fleet.load.policy is policy
    assert ctx.metrics.calibration is policy.calibration
    text = ctx.metrics.render().decode()
    assert 'fastroute_proxy_calibration_samples{kind="prefill",type="a40"} 0.0' in text
    policy.calibration.observe_decode("a40", 1, 4, 400, 0.03)
    text = ctx.metrics.render().decode()
    assert 'fastroute_proxy_calibration_samples{kind="decode",type="a40"} 1.0' in text
    assert 'fastroute_proxy_calibration_samples{kind="transfer",type="kv-transfer"} 0.0' in text


def test_a_reload_keeps_what_was_learned() -> None:
    config = decode_config(MARGINAL)
    first = build_context(config, None, None)
    second = build_context(config, None, first)
    old, new = first.policies["marginal-cost"], second.policies["marginal-cost"]
    assert new is not old
    assert new.calibration is old.calibration and new.output_lengths is old.output_lengths
    assert second.metrics is first.metrics and second.metrics.calibration is new.calibration


def test_other_policies_get_no_engine_load_or_calibration_metrics() -> None:
    ctx = build_context(decode_config(_ENGINES), None, None)
    assert ctx.fleet.load is None
    assert ctx.pd is not None and ctx.pd.prefill.load is None and ctx.pd.decode.load is None
    assert b"fastroute_proxy_calibration" not in ctx.metrics.render()
