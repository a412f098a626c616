"""The engines state file: the fleet changes made at run time, kept across restarts.

``<config>.engines.json`` (next to the config file) holds what the config file does not:
the engines added through the admin API, the engines marked draining, and the last
address set of every ``[[discovery]]`` name (with its failure count). Every writer (a
proxy worker answering the admin API, the supervisor's discovery) changes it through
:func:`update_state`: read, change, write a temporary file, ``fsync`` and rename, under
an exclusive ``flock`` of ``<state>.lock``, so concurrent writers never lose an update
and readers never see half a file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import msgspec

from fastroute.config import ConfigError, EngineConfig, decode_engine

__all__ = [
    "STATE_SUFFIX",
    "STATE_VERSION",
    "Address",
    "DiscoveryStatus",
    "EngineState",
    "state_path_of",
    "read_state",
    "update_state",
    "state_signature",
    "with_discovery",
]

#: The state file's name is the config file's plus this suffix.
STATE_SUFFIX = ".engines.json"
#: Format version written to (and required in) the file.
STATE_VERSION = 1


@dataclass(frozen=True, order=True)
class Address:
    """One discovered engine address."""

    host: str
    port: int


@dataclass(frozen=True)
class DiscoveryStatus:
    """The last resolution of one ``[[discovery]]`` name.

    Attributes
    ----------
    addresses : tuple of Address
        The last set resolved (kept when a later resolution fails).
    failures : int
        Failed resolutions since the proxy started.
    last_error : str or None
        The last failure's message.
    resolved_at : float or None
        Unix time of the last successful resolution.
    """

    addresses: tuple[Address, ...] = ()
    failures: int = 0
    last_error: str | None = None
    resolved_at: float | None = None


@dataclass(frozen=True)
class EngineState:
    """The state file's content.

    Attributes
    ----------
    engines : tuple of EngineConfig
        Engines added through the admin API, in order of addition.
    draining : frozenset of str
        Names of engines (any source) that get no new requests.
    discovery : mapping of str to DiscoveryStatus
        By ``[[discovery]]`` name.
    """

    engines: tuple[EngineConfig, ...] = ()
    draining: frozenset[str] = frozenset()
    discovery: Mapping[str, DiscoveryStatus] = field(default_factory=dict)


class _AddressFile(msgspec.Struct, forbid_unknown_fields=True):
    host: str
    port: int


class _StatusFile(msgspec.Struct, forbid_unknown_fields=True):
    addresses: list[_AddressFile] = []
    failures: int = 0
    last_error: str | None = None
    resolved_at: float | None = None


class _StateFile(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    engines: list[dict[str, object]] = []
    draining: list[str] = []
    discovery: dict[str, _StatusFile] = {}


def state_path_of(config_path: str | Path) -> Path:
    """The state file of the config file at ``config_path`` (absolute)."""
    path = Path(config_path).resolve()
    return path.with_name(path.name + STATE_SUFFIX)


def read_state(path: Path) -> EngineState:
    """The state in ``path``; empty when the file does not exist.

    Raises
    ------
    ConfigError
        The file exists but cannot be read or is not a valid state file.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return EngineState()
    except OSError as exc:
        raise ConfigError(
            str(path), [(None, f"cannot read the engines state file: {exc}")]
        ) from exc
    return _decode(data, str(path))


def _decode(data: bytes, source: str) -> EngineState:
    try:
        raw = msgspec.json.decode(data, type=_StateFile)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ConfigError(source, [(None, f"invalid engines state file: {exc}")]) from exc
    if raw.version != STATE_VERSION:
        raise ConfigError(
            source, [("$.version", f"expected version {STATE_VERSION}, got {raw.version}")]
        )
    engines = tuple(
        decode_engine(e, f"{source}: $.engines[{i}]") for i, e in enumerate(raw.engines)
    )
    discovery = {
        name: DiscoveryStatus(
            addresses=tuple(Address(a.host, a.port) for a in st.addresses),
            failures=st.failures,
            last_error=st.last_error,
            resolved_at=st.resolved_at,
        )
        for name, st in raw.discovery.items()
    }
    return EngineState(engines=engines, draining=frozenset(raw.draining), discovery=discovery)


def _encode(state: EngineState) -> bytes:
    raw = _StateFile(
        version=STATE_VERSION,
        engines=[msgspec.to_builtins(e) for e in state.engines],
        draining=sorted(state.draining),
        discovery={
            name: _StatusFile(
                addresses=[_AddressFile(a.host, a.port) for a in st.addresses],
                failures=st.failures,
                last_error=st.last_error,
                resolved_at=st.resolved_at,
            )
            for name, st in sorted(state.discovery.items())
        },
    )
    return msgspec.json.format(msgspec.json.encode(raw), indent=2) + b"\n"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)


def update_state(
    path: Path, change: Callable[[EngineState], EngineState | None]
) -> tuple[EngineState, bool]:
    """Apply ``change`` to the state in ``path`` under the file lock and write the result.

    Parameters
    ----------
    path : Path
        The state file (created when missing).
    change : callable
        Gets the current state, returns the new one, or None for "no change" (nothing
        is written). It may raise to abort (nothing is written, the error propagates).

    Returns
    -------
    (EngineState, bool)
        The state in force afterwards, and whether the file was written.

    Raises
    ------
    ConfigError
        The current file is invalid.
    OSError
        The file or its lock cannot be written.
    """
    with _locked(path):
        current = read_state(path)
        new = change(current)
        if new is None or new == current:
            return current, False
        _write_atomic(path, _encode(new))
        return new, True


def state_signature(path: Path) -> tuple[int, int] | None:
    """``(mtime_ns, inode)`` of the state file, None when absent: changes with every write
    (a write renames a new file into place)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_mtime_ns, st.st_ino


def with_discovery(state: EngineState, name: str, status: DiscoveryStatus) -> EngineState:
    """``state`` with the status of discovery ``name`` replaced."""
    return replace(state, discovery={**state.discovery, name: status})
