"""Policy names -> classes, and construction from configuration.

The configuration names a policy per request class (``policy = "cache-aware"`` plus
its tunables); :func:`make_policy` turns that into an instance and rejects unknown
names and parameters with an error that lists what is valid. The registry is a plain
dict built here, not filled by import side effects (vidur's registries are what we
avoid).

The names themselves are :data:`fastroute.config.POLICY_NAMES` (the ``PolicyName``
literal the configuration is decoded with): the configuration stays importable without
the policies and their numpy/predict dependencies. This module checks at import that
the two agree, so a policy without a name, or a name without a policy, fails at once.
"""

from __future__ import annotations

import inspect
from typing import Any

from fastroute.config import POLICY_NAMES, PolicyConfig
from fastroute.policy.base import Policy, PolicyConfigError
from fastroute.policy.cache_aware import CacheAware
from fastroute.policy.consistent_hash import ConsistentHash
from fastroute.policy.least_request import LeastRequest
from fastroute.policy.length_heuristic import LengthHeuristic
from fastroute.policy.marginal import MarginalCost
from fastroute.policy.power_of_two import PowerOfTwo
from fastroute.policy.prefix_hrw import PrefixHRW
from fastroute.policy.round_robin import RoundRobin
from fastroute.policy.weighted_hrw import WeightedHRW

__all__ = ["POLICIES", "DEFAULT_POLICY", "check_names", "make_policy", "policy_params"]


def check_names(policies: dict[str, type[Policy]], names: tuple[str, ...]) -> None:
    """Raise if ``policies`` (the registry) and ``names`` (the configuration's) differ.

    Raises
    ------
    RuntimeError
        Naming the names without a policy and the policies without a name.
    """
    missing = sorted(set(names) - set(policies))
    unnamed = sorted(set(policies) - set(names))
    if missing or unnamed:
        raise RuntimeError(
            f"fastroute.config.POLICY_NAMES and the policy registry disagree: "
            f"no policy for {missing}, no name in the configuration for {unnamed}"
        )


#: Every policy by its registered name (exactly :data:`fastroute.config.POLICY_NAMES`).
POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        PrefixHRW,
        WeightedHRW,
        RoundRobin,
        LeastRequest,
        PowerOfTwo,
        ConsistentHash,
        CacheAware,
        MarginalCost,
        LengthHeuristic,
    )
}
check_names(POLICIES, POLICY_NAMES)

#: The policy of a class that names none (the configuration's default).
DEFAULT_POLICY: str = PolicyConfig().default


def policy_params(name: str) -> dict[str, Any]:
    """The tunables of policy ``name`` and their defaults.

    Raises
    ------
    PolicyConfigError
        ``name`` is not registered.
    """
    cls = _lookup(name)
    return {
        p.name: p.default
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


def make_policy(name: str, **params: Any) -> Policy:
    """Build the policy registered as ``name`` with its tunables ``params``.

    Parameters
    ----------
    name : str
        A key of :data:`POLICIES`, for example ``"weighted-hrw"``.
    **params
        Keyword tunables of that policy (see its module docstring for units).

    Returns
    -------
    Policy
        A fresh instance.

    Raises
    ------
    PolicyConfigError
        Unknown name (the message lists the valid ones), a parameter the policy does
        not take (the message lists those it does), or an invalid value.
    """
    cls = _lookup(name)
    accepted = policy_params(name)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        valid = ", ".join(sorted(accepted)) or "none"
        raise PolicyConfigError(
            f"policy {name!r} has no parameter {', '.join(map(repr, unknown))}; "
            f"valid parameters: {valid}"
        )
    return cls(**params)


def _lookup(name: str) -> type[Policy]:
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        raise PolicyConfigError(
            f"unknown routing policy {name!r}; valid policies: {', '.join(sorted(POLICIES))}"
        ) from None
