"""The fleet in force: config engines + state-file engines + discovered engines, in one place.

:func:`merge_fleet` is the one function that decides which engines route: the proxy
workers (start and every reload), the supervisor (stats-block slots) and the controller
all build their :class:`~fastroute.config.Config` through :func:`load_effective_config`.

Precedence on a name clash: the config file, then the admin API, then discovery (a
discovered address that is already some engine's address is skipped, so a DNS record
never makes the fleet invalid). Engines marked draining are listed but not in the
config in force: the reload that removes them lets their requests in flight finish on
the old generation, as for any engine removed from the config.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import msgspec

from fastroute.config import (
    Config,
    ConfigError,
    DiscoveryConfig,
    EngineConfig,
    load_config,
    validate_config,
)
from fastroute.discovery.state_file import Address, EngineState, read_state, state_path_of

__all__ = [
    "EngineSource",
    "FleetEntry",
    "MergedFleet",
    "discovered_engine",
    "merge_fleet",
    "load_effective_config",
]

logger = logging.getLogger(__name__)

#: Where an engine of the fleet comes from.
EngineSource = Literal["config", "admin", "dns"]
#: Longest engine name (the config's ``Name`` pattern); longer discovered names are hashed.
_MAX_NAME_LEN = 128
_NAME_HASH_HEX = 12


@dataclass(frozen=True)
class FleetEntry:
    """One engine of the merged fleet, with where it came from."""

    engine: EngineConfig
    source: EngineSource
    draining: bool


@dataclass(frozen=True)
class MergedFleet:
    """The merged fleet: every engine (draining ones too) and the config in force."""

    entries: tuple[FleetEntry, ...]
    config: Config

    def entry(self, name: str) -> FleetEntry | None:
        """The entry called ``name``, or None."""
        for entry in self.entries:
            if entry.engine.name == name:
                return entry
        return None


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def discovered_engine(disc: DiscoveryConfig, address: Address) -> EngineConfig:
    """The engine of ``disc`` at ``address``: named ``{disc.name}/{host}:{port}``."""
    name = f"{disc.name}/{address.host}:{address.port}"
    if len(name) > _MAX_NAME_LEN:  # a long SRV target: keep the prefix, make it unique
        digest = hashlib.sha256(name.encode()).hexdigest()[:_NAME_HASH_HEX]
        name = f"{name[: _MAX_NAME_LEN - _NAME_HASH_HEX - 1]}~{digest}"
    return EngineConfig(
        name=name,
        url=f"{disc.scheme}://{_bracket(address.host)}:{address.port}",
        models=disc.models,
        region=disc.region,
        zone=disc.zone,
        hardware=disc.hardware,
        role=disc.role,
        capacity_rps=disc.capacity_rps,
        max_concurrency=disc.max_concurrency,
        api_key=disc.api_key,
        kind=disc.kind,
    )


def _address_key(url: str) -> tuple[str, int | None]:
    parts = urlsplit(url)
    return (parts.hostname or "").lower(), parts.port


def merge_fleet(config: Config, state: EngineState, source: str = "<state>") -> MergedFleet:
    """Merge the config file's engines with the state file's and the discovered ones.

    Parameters
    ----------
    config : Config
        The validated config file.
    state : EngineState
        The engines state file's content.
    source : str
        Name for error messages (the state file's path).

    Returns
    -------
    MergedFleet

    Raises
    ------
    ConfigError
        The merged fleet breaks a config rule (e.g. an admin engine's region was
        removed from the config, or draining leaves a model without engines); the
        message names ``source``.
    """
    entries: list[FleetEntry] = []
    names: set[str] = set()
    addresses: set[tuple[str, int | None]] = set()

    def add(engine: EngineConfig, origin: EngineSource) -> None:
        key = _address_key(engine.url)
        if engine.name in names or (origin == "dns" and key in addresses):
            if origin != "dns":
                logger.warning(
                    "engine %r from the %s is also defined earlier: ignored", engine.name, origin
                )
            return
        names.add(engine.name)
        addresses.add(key)
        entries.append(FleetEntry(engine, origin, engine.name in state.draining))

    for engine in config.engines:
        add(engine, "config")
    for engine in state.engines:
        add(engine, "admin")
    for disc in config.discovery:
        status = state.discovery.get(disc.name)
        for address in sorted(status.addresses) if status is not None else ():
            add(discovered_engine(disc, address), "dns")
    serving = tuple(e.engine for e in entries if not e.draining)
    if not serving:
        raise ConfigError(source, [("$.draining", "every engine would be draining or gone")])
    merged = msgspec.structs.replace(config, engines=serving)
    return MergedFleet(tuple(entries), validate_config(merged, source=source))


def load_effective_config(config_path: str | Path) -> Config:
    """Read the config file and its engines state file; return the config in force.

    Raises
    ------
    ConfigError
        Either file is invalid, or their merge is (:func:`merge_fleet`).
    """
    config = load_config(config_path)
    path = state_path_of(config_path)
    return merge_fleet(config, read_state(path), source=str(path)).config
