"""The fleet admin API: add, drain and remove engines without editing the config file.

Routes (loopback, or ``proxy.admin_token`` as a bearer token, like the decision records)
-----------------------------------------------------------------------------------------
``GET /admin/engines``
    The merged fleet (:func:`fastroute.discovery.merge.merge_fleet`): every engine with
    its ``source`` (``config``, ``admin``, ``dns``), ``state`` (``active``/``draining``)
    and whether this worker routes to it yet (``in_force``); the discovery status.
``POST /admin/engines``
    Body: the fields of a config ``[[engines]]`` entry. 201; 400 with the config
    validator's message when invalid; 409 when the name exists.
``DELETE /admin/engines/{name}``
    Remove an engine added through this API; requests in flight on it finish (the
    reload retires the old generation only when they are done). 404 unknown; 409 for
    engines of the config file or DNS (edit those at their source, or drain them).
``POST /admin/engines/{name}/drain`` and ``/resume``
    Stop (resume) sending new requests to an engine of any source; a draining engine
    stays listed.

A change is written to the engines state file (:mod:`fastroute.discovery.state_file`)
and then applied through the ordinary reload path: the worker that took the request
signals its supervisor (SIGHUP), which gives new engines stats slots and reloads every
worker; a proxy without a supervisor reloads itself. The reply comes once the file is
written; workers switch a few milliseconds later.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import msgspec

from fastroute.config import Config, ConfigError, EngineConfig, decode_engine, load_config
from fastroute.discovery.merge import FleetEntry, MergedFleet, merge_fleet
from fastroute.discovery.state_file import (
    DiscoveryStatus,
    EngineState,
    read_state,
    state_path_of,
    update_state,
)
from fastroute.proxy.http.openai_errors import error_reply
from fastroute.proxy.http.reply import Reply
from fastroute.proxy.path.handler import ProxyContext
from fastroute.proxy.routes import admin_allowed, not_allowed

__all__ = ["ADMIN_ENGINES_PATH", "FleetAdmin", "is_admin_engines_path"]

logger = logging.getLogger(__name__)

#: The collection's path; an engine's is ``{ADMIN_ENGINES_PATH}/{name}``.
ADMIN_ENGINES_PATH = "/admin/engines"
_ACTIONS = ("drain", "resume")


def is_admin_engines_path(path: str) -> bool:
    """``path`` is one of this module's routes."""
    return path == ADMIN_ENGINES_PATH or path.startswith(ADMIN_ENGINES_PATH + "/")


class _Refusal(Exception):
    """A request this API turns down: HTTP status, message, error code."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def _json(data: object, status: int = 200) -> Reply:
    return Reply(status, [("Content-Type", "application/json")], msgspec.json.encode(data))


def _entry_json(merged: MergedFleet, name: str, in_force: set[str]) -> dict[str, Any]:
    entry = merged.entry(name)
    assert entry is not None
    return _as_json(entry, in_force)


def _as_json(entry: FleetEntry, in_force: set[str]) -> dict[str, Any]:
    data = msgspec.to_builtins(entry.engine)
    data.pop("api_key", None)  # a secret: never echoed
    data["source"] = entry.source
    data["state"] = "draining" if entry.draining else "active"
    data["in_force"] = entry.engine.name in in_force
    return data


@dataclass
class FleetAdmin:
    """The admin API of one proxy worker.

    Parameters
    ----------
    config_path : Path or None
        The config file; without one (a proxy built from a Config object) every route
        answers 409.
    context : callable
        The request-path context in force (admin token, the engines this worker routes to).
    apply : callable
        Makes every worker re-read the fleet (signal the supervisor, or reload this app).
    """

    config_path: Path | None
    context: Callable[[], ProxyContext]
    apply: Callable[[], None]

    async def reply(
        self,
        method: str,
        path: str,
        body: bytes | None,
        headers: Mapping[str, str],
        remote: str | None,
    ) -> Reply:
        """Answer one request to an :func:`is_admin_engines_path` path."""
        if not admin_allowed(self.context(), headers, remote):
            return error_reply(
                403, "Admin endpoints need loopback or the admin token.", code="forbidden"
            )
        name, action = _parse(path)
        allowed = _allowed_methods(name, action)
        if method not in allowed:
            return not_allowed(method, path, allowed)
        if self.config_path is None:
            return error_reply(
                409, "This proxy was not started from a config file.", code="no_config_file"
            )
        try:
            result = await asyncio.to_thread(self._serve, method, name, action, body)
        except _Refusal as exc:
            return error_reply(exc.status, str(exc), code=exc.code)
        except (ConfigError, OSError) as exc:  # the files themselves are unusable
            logger.error("admin engines: %s", exc)
            return error_reply(500, str(exc), code="engines_state_error")
        status, data, changed = result
        if changed:
            self.apply()
        return _json(data, status)

    def _serve(
        self, method: str, name: str | None, action: str | None, body: bytes | None
    ) -> tuple[int, object, bool]:
        """The file work of one request, off the event loop: (status, body, changed)."""
        assert self.config_path is not None
        config = load_config(self.config_path)
        state_path = state_path_of(self.config_path)
        in_force = {e.name for e in self.context().config.engines}
        if method in ("GET", "HEAD"):
            return (
                200,
                self._listing(config, read_state(state_path), str(state_path), in_force),
                False,
            )
        if name is None:
            engine = _decode_engine(_decode_body(body))
            name = engine.name
            change = _adder(config, engine, str(state_path))
        elif action is None:
            change = _remover(config, name, str(state_path))
        else:
            change = _drainer(config, name, action == "drain", str(state_path))
        state, changed = update_state(state_path, change)
        merged = merge_fleet(config, state, str(state_path))
        if method == "POST" and action is None:
            return 201, _entry_json(merged, name, in_force), changed
        if action is None:
            return 200, {"name": name, "state": "removed"}, changed
        return 200, _entry_json(merged, name, in_force), changed

    def _listing(
        self, config: Config, state: EngineState, source: str, in_force: set[str]
    ) -> dict[str, Any]:
        merged = merge_fleet(config, state, source)
        discovery = []
        for d in config.discovery:
            status = state.discovery.get(d.name, DiscoveryStatus())
            discovery.append(
                {
                    "name": d.name,
                    "dns_name": d.dns_name,
                    "record": d.record,
                    "engines": len(status.addresses),
                    "failures": status.failures,
                    "last_error": status.last_error,
                    "resolved_at": status.resolved_at,
                }
            )
        return {
            "worker_pid": os.getpid(),
            "state_file": source,
            "engines": [_as_json(e, in_force) for e in merged.entries],
            "discovery": discovery,
        }


def _parse(path: str) -> tuple[str | None, str | None]:
    """(engine name or None, action or None) of an admin engines path."""
    rest = path[len(ADMIN_ENGINES_PATH) + 1 :]
    if not rest:
        return None, None
    rest = unquote(rest)
    for action in _ACTIONS:
        if rest.endswith("/" + action):
            return rest[: -len(action) - 1], action
    return rest, None


def _allowed_methods(name: str | None, action: str | None) -> tuple[str, ...]:
    if name is None:
        return ("GET", "HEAD", "POST")
    if action is None:
        return ("DELETE",)
    return ("POST",)


def _decode_body(body: bytes | None) -> object:
    if body is None:
        raise _Refusal(413, "The request body is over limits.max_body_bytes.", "body_too_large")
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise _Refusal(400, f"The body is not JSON: {exc}", "invalid_json") from exc


def _checked(config: Config, state: EngineState, source: str, status: int) -> EngineState:
    """``state`` if the merged fleet it gives is valid, else a refusal with the reason."""
    try:
        merge_fleet(config, state, source)
    except ConfigError as exc:
        raise _Refusal(status, str(exc), "invalid_engine") from exc
    return state


def _decode_engine(data: object) -> EngineConfig:
    try:
        return decode_engine(data, "engine")
    except ConfigError as exc:
        raise _Refusal(400, str(exc), "invalid_engine") from exc


def _adder(
    config: Config, engine: EngineConfig, source: str
) -> Callable[[EngineState], EngineState]:
    def change(state: EngineState) -> EngineState:
        if merge_fleet(config, state, source).entry(engine.name) is not None:
            raise _Refusal(409, f"An engine named {engine.name!r} exists.", "engine_exists")
        return _checked(config, replace(state, engines=(*state.engines, engine)), source, 400)

    return change


def _find(config: Config, state: EngineState, name: str, source: str) -> str:
    entry = merge_fleet(config, state, source).entry(name)
    if entry is None:
        raise _Refusal(404, f"No engine named {name!r}.", "engine_not_found")
    return entry.source


def _remover(config: Config, name: str, source: str) -> Callable[[EngineState], EngineState]:
    def change(state: EngineState) -> EngineState:
        origin = _find(config, state, name, source)
        if origin != "admin":
            where = "the config file" if origin == "config" else "DNS"
            raise _Refusal(
                409,
                f"Engine {name!r} comes from {where}: remove it there, or drain it.",
                "engine_not_removable",
            )
        kept = tuple(e for e in state.engines if e.name != name)
        return _checked(
            config, replace(state, engines=kept, draining=state.draining - {name}), source, 409
        )

    return change


def _drainer(
    config: Config, name: str, drain: bool, source: str
) -> Callable[[EngineState], EngineState]:
    def change(state: EngineState) -> EngineState:
        _find(config, state, name, source)
        draining = state.draining | {name} if drain else state.draining - {name}
        return _checked(config, replace(state, draining=draining), source, 409)

    return change
