"""Disaggregated prefill/decode (P/D) in the proxy: the pools, and vLLM's protocol.

A model served by ``role = "prefill"`` and ``role = "decode"`` engines and by no
``both`` engine is a P/D model. Its engines' ``kind`` picks the protocol
(:attr:`PDPools.protocols`): SGLang engines speak SGLang's bootstrap protocol, the same
request to both engines at once (:mod:`fastroute.proxy.path.pd_bootstrap`); the others
vLLM's ``kv_transfer_params`` protocol, in two steps (vLLM's disaggregated serving proxy
protocol, as the emulator implements it):

1. **Prefill** on an engine of the prefill pool: the original body with
   ``max_tokens: 1`` (and ``max_completion_tokens: 1`` if present), ``stream: false``,
   ``n: 1``, without the fields a one-token answer conflicts with (``min_tokens``,
   ``stream_options``...: :func:`prefill_body`) and with ``kv_transfer_params =
   {"do_remote_decode": true, "do_remote_prefill": false, ...}``. The engine computes
   the prompt's KV, keeps it, and answers JSON whose ``kv_transfer_params`` say where
   it is (``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``,
   ``remote_host``, ``remote_port``).
2. **Decode** on an engine of the decode pool: the original body (streamed or not, as
   the client asked) plus the returned ``kv_transfer_params``; the decode engine pulls
   the KV and generates. Its response is relayed to the client like any other, with
   the prefill's ``cached_tokens`` in its usage (:mod:`fastroute.proxy.path.pd_usage`).

Each pool is a :class:`~fastroute.proxy.path.fleet.Fleet` of its own: its own eligibility,
in-flight counts and outlier detector, so a dead prefill pool never marks a decode
engine unhealthy, and the reverse. Pool weights are capacity-proportional (the
controller's table has no P/D rows yet). Retries follow the retry budget as for
whole requests: a prefill that fails before answering is retried on the next ranked
prefill engine, a decode that fails before its first byte on the next ranked decode
engine (with the same ``kv_transfer_params``: a decode engine that fails before
claiming the KV leaves it with the prefill engine).

Pair selection is behind :class:`PairSelector`; the default
(:class:`IndependentPairs`) runs the class's configured policy over each pool. A
cost-based pair selector (``fastroute/policy/marginal.py``) plugs in there.
"""

from __future__ import annotations

from typing import Any

import msgspec

from fastroute.config import Config, PDProtocol, pd_protocol_of
from fastroute.policy import IndependentPairs, PairSelector, Policy
from fastroute.proxy.path.fleet import Fleet
from fastroute.tables.stats import StatsBlock

__all__ = [
    "PDPools",
    "prefill_body",
    "PREFILL_DROPPED",
    "decode_body",
    "transfer_params",
    "PDProtocolError",
]

#: ``kv_transfer_params`` of the prefill step (vLLM's disaggregated proxy sends these).
PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class PDProtocolError(Exception):
    """A prefill engine answered 200 without usable ``kv_transfer_params``."""


def _pool_config(config: Config, role: str) -> Config:
    """``config`` restricted to the engines of ``role``, presented as whole-request
    engines so a :class:`Fleet` serves them."""
    engines = tuple(
        msgspec.structs.replace(e, role="both") for e in config.engines if e.role == role
    )
    return msgspec.structs.replace(config, engines=engines)


class PDPools:
    """The prefill and decode pools of a config, with a pair selector per policy name.

    Parameters
    ----------
    config : Config
    prefill_policies, decode_policies : dict of str to Policy
        One instance per policy name the config uses, for each pool
        (``fastroute.proxy.path.handler.build_policies`` called twice).
    stats_block : StatsBlock, optional
        The host's stats block (engines are found in it by id).

    Attributes
    ----------
    models : frozenset of str
        Models served by P/D: a prefill and a decode engine, and no ``both`` engine.
    protocols : dict of str to {"nixl", "bootstrap"}
        Each P/D model's protocol, from its engines' kind (``bootstrap``: SGLang's).
    prefill, decode : Fleet
    prefill_policies, decode_policies : dict of str to Policy
        Each pool's policy instances (``on_routed``/``on_complete`` go to these).
    """

    def __init__(
        self,
        config: Config,
        prefill_policies: dict[str, Policy],
        decode_policies: dict[str, Policy],
        stats_block: StatsBlock | None = None,
    ) -> None:
        by_role: dict[str, set[str]] = {"both": set(), "prefill": set(), "decode": set()}
        for e in config.engines:
            by_role[e.role].update(e.models)
        self.models = frozenset((by_role["prefill"] & by_role["decode"]) - by_role["both"])
        self.protocols: dict[str, PDProtocol] = {
            model: pd_protocol_of(
                e.kind for e in config.engines if model in e.models and e.role != "both"
            )
            for model in self.models
        }
        self.prefill = Fleet(_pool_config(config, "prefill"), stats_block=stats_block)
        self.decode = Fleet(_pool_config(config, "decode"), stats_block=stats_block)
        self.prefill_policies = prefill_policies
        self.decode_policies = decode_policies
        self._selectors = {
            name: IndependentPairs(prefill_policies[name], decode_policies[name])
            for name in prefill_policies
        }

    @staticmethod
    def needed(config: Config) -> bool:
        """Whether ``config`` has both prefill and decode engines."""
        roles = {e.role for e in config.engines}
        return {"prefill", "decode"} <= roles

    def selector(self, policy_name: str) -> PairSelector:
        """The pair selector for a class whose policy is ``policy_name``."""
        return self._selectors[policy_name]

    def set_selector(self, policy_name: str, selector: PairSelector) -> None:
        """Use ``selector`` for classes with policy ``policy_name`` (e.g. a cost model)."""
        self._selectors[policy_name] = selector


#: Fields of the client's request the prefill step drops: each conflicts with a
#: one-token, not streamed answer (vLLM rejects the body otherwise), or only matters to
#: the tokens the decode engine generates. The decode step gets them all back.
PREFILL_DROPPED = (
    # vLLM's SamplingParams: ``min_tokens > max_tokens`` is a 400, so any request with
    # min_tokens >= 2 would fail at the prefill (vLLM's reference P/D proxy drops both)
    "min_tokens",
    "min_completion_tokens",
    # vLLM: "Stream options can only be defined when `stream=True`" (400)
    "stream_options",
    # best_of >= n is checked against n, which the prefill sets to 1; one token of one
    # sequence is all a prefill answers (its text is thrown away)
    "best_of",
)


def prefill_body(request: dict[str, Any]) -> bytes:
    """The prefill step's body: one token, not streamed, KV kept for a decode engine.

    ``max_tokens`` (and ``max_completion_tokens`` if present) become 1, ``stream``
    false, ``n`` 1 (the prompt's KV is the same for every choice; the decode engine
    samples the client's ``n``), the fields of :data:`PREFILL_DROPPED` go, and
    ``kv_transfer_params`` asks the engine to keep the KV. Everything else stays: it is
    valid with one output token (``stop``, ``logprobs``/``top_logprobs``, penalties,
    ``response_format``, ``ignore_eos``...) and the engine must see the same prompt
    (``messages``, ``prompt``, ``tools``, chat template fields) for the KV to match.
    """
    body = {k: v for k, v in request.items() if k not in PREFILL_DROPPED}
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    if "n" in body:
        body["n"] = 1
    body["kv_transfer_params"] = PREFILL_PARAMS
    return msgspec.json.encode(body)


def decode_body(request: dict[str, Any], params: dict[str, Any]) -> bytes:
    """The decode step's body: the client's request plus the prefill's transfer params."""
    body = dict(request)
    body["kv_transfer_params"] = params
    return msgspec.json.encode(body)


def transfer_params(prefill_response: bytes) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a prefill engine's JSON answer.

    Raises
    ------
    PDProtocolError
        Not JSON, or no ``kv_transfer_params`` object in it.
    """
    try:
        params = msgspec.json.decode(prefill_response)["kv_transfer_params"]
    except (msgspec.DecodeError, KeyError, TypeError):
        params = None
    if not isinstance(params, dict):
        raise PDProtocolError("the prefill engine's answer has no kv_transfer_params")
    return params
