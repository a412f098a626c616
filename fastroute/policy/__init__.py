"""Routing policies behind one interface, used by both the proxy and the simulator.

A :class:`Policy` turns a :class:`RouteRequest` and a :class:`FleetView` into a
:class:`Decision` (a failover ranking of at most ``k`` engines, first = chosen).
Registered policies (:data:`POLICIES`, built with :func:`make_policy`):

``prefix-hrw`` (default)
    rendezvous homes of the prompt's prefix depths on the controller's weights, the
    shallowest home within its bounded share of queued prompt tokens;
``weighted-hrw``
    weighted rendezvous hashing on the controller's weights, optional bounded-load guard;
``round-robin``
    cycle through the eligible engines;
``least-request``
    fewest in-flight requests (host-wide);
``power-of-two``
    two random engines, fewer in flight wins;
``consistent-hash``
    unweighted rendezvous hashing on the routing key;
``cache-aware``
    SGLang-style approximate prefix tree per engine with balance thresholds;
``marginal-cost``
    calibrated marginal completion time over the top-k rendezvous candidates (P/D pair
    selection, SLO early rejection); see ``docs/predict.md``.

Disaggregated (P/D) classes rank a prefill and a decode engine in one call, through a
:class:`PairSelector` (:mod:`fastroute.policy.pairs`).

Each module's docstring states its algorithm, invariants, tunables and units;
``docs/policies.md`` compares them.
"""

from fastroute.policy.base import (
    DEFAULT_K,
    Decision,
    FleetView,
    Policy,
    PolicyConfigError,
    RouteRequest,
    StaticFleetView,
)
from fastroute.policy.cache_aware import CacheAware
from fastroute.policy.consistent_hash import ConsistentHash
from fastroute.policy.least_request import LeastRequest
from fastroute.policy.marginal import MarginalCost
from fastroute.policy.pairs import IndependentPairs, PairSelector
from fastroute.policy.power_of_two import PowerOfTwo
from fastroute.policy.prefix_hrw import PrefixHRW
from fastroute.policy.registry import DEFAULT_POLICY, POLICIES, make_policy, policy_params
from fastroute.policy.round_robin import RoundRobin
from fastroute.policy.weighted_hrw import WeightedHRW

__all__ = [
    "DEFAULT_K",
    "DEFAULT_POLICY",
    "POLICIES",
    "CacheAware",
    "ConsistentHash",
    "Decision",
    "FleetView",
    "IndependentPairs",
    "LeastRequest",
    "MarginalCost",
    "PairSelector",
    "Policy",
    "PolicyConfigError",
    "PowerOfTwo",
    "PrefixHRW",
    "RoundRobin",
    "RouteRequest",
    "StaticFleetView",
    "WeightedHRW",
    "make_policy",
    "policy_params",
]
