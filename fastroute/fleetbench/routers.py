"""Routers under test: names → how to start them and when they are ready.

========================  =============================================================
name                      what runs
========================  =============================================================
``fastroute``             controller + one ``fastroute serve`` per source cluster
``fastroute:<policy>``    the same with ``policy.default = <policy>``
``sglang:<policy>``       ``python -m sglang_router.launch_router --policy <policy>``
``vllm-router:<policy>``  ``vllm-router --policy <policy>`` (PyPI ``vllm-router``)
a variant's name          fastroute with a ``[fastroute_variants]`` entry's policy and
                          ``[policy.params.<policy>]``
any other                 a ``[router_commands]`` template of the spec
========================  =============================================================

External routers get every engine URL and know nothing of models or source
clusters: one instance per source cluster (the same shape as fastroute's proxies),
and a spec comparing them should serve one model. They are ready when a real chat
request through them answers 200.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fastroute.config import DEFAULT_POLICY_NAME
from fastroute.fleetbench.spec import FastrouteVariant, RouterCommand

__all__ = ["RouterPlan", "resolve_router", "expand_command", "BUILTIN_TEMPLATES"]

#: Command templates of the external routers known by name.
BUILTIN_TEMPLATES: dict[str, RouterCommand] = {
    "sglang": RouterCommand(
        command=(
            "{python}", "-m", "sglang_router.launch_router", "--worker-urls", "{worker_urls}",
            "--policy", "{policy}", "--host", "{host}", "--port", "{port}",
            "--prometheus-port", "{metrics_port}", "--log-level", "warn",
        ),
        requires_module="sglang_router",
    ),
    "vllm-router": RouterCommand(
        command=(
            "{vllm_router}", "--worker-urls", "{worker_urls}", "--policy", "{policy}",
            "--host", "{host}", "--port", "{port}", "--prometheus-port", "{metrics_port}",
            "--log-level", "warning",
        ),
        requires_executable="vllm-router",
    ),
}  # fmt: skip


@dataclass(frozen=True)
class RouterPlan:
    """A resolved router name.

    Attributes
    ----------
    name : str
        As given in the spec.
    kind : {"fastroute", "command"}
    policy : str or None
        fastroute's ``policy.default``, or the ``{policy}`` of a template.
    template : RouterCommand or None
        For ``command`` routers.
    unavailable : str or None
        Why it cannot run here (module missing, program not found), else None.
    params : mapping or None
        fastroute's ``[policy.params.<policy>]`` (a variant's tunables).
    hardware : str or None
        A variant's ``hardware`` label for every engine of the config.
    hedge : bool
        A variant's ``hedge``: its classes hedge first tokens.
    workers, proxies : int
        A variant's ``proxy.workers`` and its proxies per source cluster.
    peers : bool
        A variant's ``peers``: the run's proxies poll each other's queues.
    proxy_settings : mapping or None
        A variant's further ``[proxy]`` keys.
    """

    name: str
    kind: str
    policy: str | None = None
    template: RouterCommand | None = None
    unavailable: str | None = None
    params: Mapping[str, bool | int | float | str] | None = None
    hardware: str | None = None
    hedge: bool = False
    workers: int = 1
    proxies: int = 1
    peers: bool = True
    proxy_settings: Mapping[str, bool | int | float | str] | None = None


def _find_executable(name: str) -> str | None:
    beside = Path(sys.executable).with_name(name)
    if beside.exists():
        return str(beside)
    return shutil.which(name)


def _check(template: RouterCommand) -> str | None:
    if template.requires_module and importlib.util.find_spec(template.requires_module) is None:
        return f"Python module {template.requires_module!r} is not importable"
    if template.requires_executable and _find_executable(template.requires_executable) is None:
        return f"program {template.requires_executable!r} not found"
    return None


def resolve_router(
    name: str,
    custom: Mapping[str, RouterCommand],
    variants: Mapping[str, FastrouteVariant] | None = None,
) -> RouterPlan:
    """Resolve a spec's router name (``variants``: the spec's ``[fastroute_variants]``).

    Raises
    ------
    ValueError
        Unknown name, or a fastroute policy that does not exist.
    """
    from fastroute.config import POLICY_NAMES

    if variants and name in variants:
        variant = variants[name]
        return RouterPlan(
            name, "fastroute", variant.policy, params=dict(variant.params),
            hardware=variant.hardware or None, hedge=variant.hedge,
            workers=variant.workers, proxies=variant.proxies, peers=variant.peers,
            proxy_settings=dict(variant.proxy),
        )  # fmt: skip
    if name in custom:
        return RouterPlan(name, "command", None, custom[name], _check(custom[name]))
    base, _, policy = name.partition(":")
    if base == "fastroute":
        policy = policy or DEFAULT_POLICY_NAME
        if policy not in POLICY_NAMES:
            raise ValueError(f"router {name!r}: unknown fastroute policy; one of {POLICY_NAMES}")
        return RouterPlan(name, "fastroute", policy)
    if base in BUILTIN_TEMPLATES:
        if not policy:
            raise ValueError(f"router {name!r}: give a policy, e.g. {base}:round_robin")
        template = BUILTIN_TEMPLATES[base]
        return RouterPlan(name, "command", policy, template, _check(template))
    known = [
        "fastroute[:policy]", *(f"{b}:policy" for b in BUILTIN_TEMPLATES), *(variants or {}),
        *custom,
    ]  # fmt: skip
    raise ValueError(f"unknown router {name!r}; known: {', '.join(known)}")


def expand_command(
    template: RouterCommand,
    *,
    port: int,
    metrics_port: int,
    worker_urls: Sequence[str],
    policy: str | None,
    host: str = "127.0.0.1",
) -> list[str]:
    """The command line of ``template`` with its placeholders filled in."""
    values = {
        "{python}": sys.executable,
        "{host}": host,
        "{port}": str(port),
        "{metrics_port}": str(metrics_port),
        "{worker_urls_csv}": ",".join(worker_urls),
        "{policy}": policy or "",
        "{vllm_router}": _find_executable("vllm-router") or "vllm-router",
    }
    out: list[str] = []
    for arg in template.command:
        if arg == "{worker_urls}":
            out.extend(worker_urls)
            continue
        for key, value in values.items():
            arg = arg.replace(key, value)
        out.append(arg)
    return out
