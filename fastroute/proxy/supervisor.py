"""The ``fastroute serve`` supervisor: N worker processes behind one port.

The supervisor (the process systemd or the user starts):

1. creates the host's shared-memory :class:`~fastroute.tables.StatsBlock`
   (``proxy.stats_name``; one slot per engine of the merged fleet — config, engines
   state file, discovered — with room for ``proxy.max_engines``) — only here, only at
   start; engines that join later get the next free slot before the workers reload
   (slots are by engine id and never reused, so stable across reloads). If another
   live proxy owns that name (e.g. an old instance still draining), it warns and uses
   ``{stats_name}-{pid}`` instead, rather than refuse to start or take over the other
   proxy's block; next to it, the stored-response id → engine map
   (:class:`~fastroute.tables.response_map.ResponseMap`, ``{stats_name}.responses``,
   ``proxy.response_map_capacity`` entries) and the prefix-key log the workers' policies
   share (:class:`~fastroute.tables.key_log.KeyLogSegment`, ``{stats_name}.keys``,
   ``proxy.key_log_entries``);
2. reserves the listen address with a bound, non-listening ``SO_REUSEPORT`` socket (so
   port 0 resolves to one port for every worker, and the port stays ours while a
   worker restarts);
3. starts N workers, ``python -m fastroute serve --worker ...`` (fork + exec through
   :mod:`subprocess`: nothing of the supervisor's state leaks into them), each
   binding the same address with ``SO_REUSEPORT``;
4. resolves the ``[[discovery]]`` names (:class:`~fastroute.discovery.runner.DiscoveryRunner`,
   a thread; once per host, not per worker) into the engines state file and signals
   itself SIGHUP when a set changed; the fleet admin API of a worker signals it too;
5. on SIGHUP gives engines that joined a stats slot, then forwards SIGHUP (reload) to
   the workers; on SIGTERM/SIGINT forwards SIGTERM (drain) and waits
   ``proxy.drain_timeout_s`` + :data:`KILL_GRACE_S` before killing stragglers;
6. restarts a worker that exits unexpectedly, after a backoff (:data:`RESTART_BACKOFF_S`
   doubling up to :data:`MAX_RESTART_BACKOFF_S`), at most :data:`MAX_RESTARTS` times in
   :data:`RESTART_WINDOW_S` — beyond that it shuts everything down and exits 1;
7. unlinks the stats block at exit;
8. tells systemd (``Type=notify``, :mod:`fastroute.systemd`) READY=1 once every worker
   listens, RELOADING=1/READY=1 around a SIGHUP, STOPPING=1 when the drain starts.

Workers die with the supervisor: they set ``PR_SET_PDEATHSIG = SIGTERM`` (drain) at
start and exit if their parent is already gone.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastroute.config import Config, ConfigError, EngineConfig, load_config
from fastroute.discovery.merge import merge_fleet
from fastroute.discovery.runner import DiscoveryRunner
from fastroute.discovery.state_file import read_state, state_path_of
from fastroute.errors import TableError, TableLockedError
from fastroute.hashing import engine_id
from fastroute.systemd import Notifier, pids_listening
from fastroute.tables.key_log import KeyLogSegment, key_log_name
from fastroute.tables.response_map import ResponseMap, response_map_name
from fastroute.tables.stats import StatsBlock
from fastroute.tables.tenant_limits import MAX_TENANTS, TenantLimitBlock, tenant_block_name

__all__ = [
    "Supervisor",
    "set_parent_death_signal",
    "KILL_GRACE_S",
    "RESTART_BACKOFF_S",
    "MAX_RESTART_BACKOFF_S",
    "MAX_RESTARTS",
    "RESTART_WINDOW_S",
]

logger = logging.getLogger(__name__)

#: Extra seconds after ``drain_timeout_s`` before stragglers get SIGKILL.
KILL_GRACE_S = 5.0
#: First restart delay of a worker that died; doubles per recent restart.
RESTART_BACKOFF_S = 0.1
#: Longest restart delay, seconds.
MAX_RESTART_BACKOFF_S = 10.0
#: Restarts allowed within :data:`RESTART_WINDOW_S` before the supervisor gives up.
MAX_RESTARTS = 10
#: Sliding window of the restart cap, seconds.
RESTART_WINDOW_S = 60.0
#: How often the supervisor checks its children without a signal while something is
#: pending (systemd readiness, a worker's restart), seconds.
_TICK_S = 0.2
#: The same once every worker runs: SIGCHLD wakes the supervisor anyway, the tick is only
#: the watchdog ping and a safety net (a 0.2 s tick cost ~1 ms of CPU per second).
_IDLE_TICK_S = 1.0
_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies.

    Returns False where ``prctl`` is unavailable (not Linux).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


@dataclass
class _Slot:
    """One worker position: its process, and when to restart it."""

    index: int
    proc: subprocess.Popen[bytes] | None = None
    restart_at: float | None = None
    restarts: collections.deque[float] = field(default_factory=collections.deque)


class Supervisor:
    """Run ``workers`` proxy workers for ``config`` and keep them running.

    Parameters
    ----------
    config_path : Path
        The config file (workers and reloads read it).
    config : Config
        The validated config read from it.
    workers : int
        Number of worker processes (>= 1).
    host, port : str, int
        Listen address; port 0 picks a free port once, for every worker.
    log_level : str
        Passed to the workers' ``--log-level``.
    """

    def __init__(
        self,
        config_path: Path,
        config: Config,
        *,
        workers: int,
        host: str,
        port: int,
        log_level: str = "INFO",
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.config_path = config_path
        self.config = config
        self.state_path = state_path_of(config_path)
        self.workers = workers
        self.host = host
        self.port = port
        self.log_level = log_level
        self._slots = [_Slot(i) for i in range(workers)]
        self._stopping = False
        self._failed = False
        self._stats: StatsBlock | None = None
        self._discovery = DiscoveryRunner((), self.state_path, lambda: None)
        #: The stats block's name (``proxy.stats_name`` unless another proxy owns it).
        self.stats_name = config.proxy.stats_name
        # systemd notify (fastroute.systemd; a no-op without $NOTIFY_SOCKET).
        self._sd = Notifier.from_env()
        self._sd_ready = False

    # -- setup -----------------------------------------------------------------------------

    def _reserve(self) -> socket.socket:
        info = socket.getaddrinfo(
            self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(info[4])
        except BaseException:
            sock.close()
            raise
        self.port = int(sock.getsockname()[1])
        return sock

    def _spawn(self, slot: _Slot) -> None:
        cmd = [
            sys.executable,
            "-m",
            "fastroute",
            "--log-level",
            self.log_level,
            "serve",
            "--config",
            str(self.config_path),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--worker",
            str(slot.index),
            "--supervisor-pid",
            str(os.getpid()),
            "--stats-name",
            self.stats_name,
        ]
        slot.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        slot.restart_at = None
        logger.info("worker %d started, pid %d", slot.index, slot.proc.pid)

    # -- main loop -------------------------------------------------------------------------

    def run(self) -> int:
        """Supervise until SIGTERM/SIGINT (or too many restarts); return the exit status."""
        stats = self._stats = self._create_stats()
        try:
            responses = ResponseMap.create(
                response_map_name(self.stats_name), self.config.proxy.response_map_capacity
            )
        except BaseException:
            stats.unlink()
            raise
        tenants = self._create_tenant_block()
        key_log = self._create_key_log()
        try:
            reserve = self._reserve()
        except BaseException:
            responses.close()
            stats.unlink()
            raise
        rfd, wfd = os.pipe()
        os.set_blocking(wfd, False)
        handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD)
        previous = {sig: signal.signal(sig, lambda *_: None) for sig in handled}
        old_wakeup = signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
        sel = selectors.DefaultSelector()
        sel.register(rfd, selectors.EVENT_READ)
        try:
            logger.info(
                "supervisor %d: %d workers on %s:%d, stats block %r",
                os.getpid(),
                self.workers,
                self.host,
                self.port,
                self.stats_name,
            )
            for slot in self._slots:
                self._spawn(slot)
            self._discovery = self._start_discovery(self.config)  # after the SIGHUP handler
            while not self._stopping:
                for sig in self._wait_signals(sel, rfd, self._tick_s()):
                    if sig in (signal.SIGTERM, signal.SIGINT):
                        logger.info("supervisor: %s, draining workers", signal.Signals(sig).name)
                        self._stopping = True
                    elif sig == signal.SIGHUP:
                        if self._sd_ready:
                            self._sd.reloading("reloading the workers")
                        self._reload()
                        if self._sd_ready:
                            self._sd.ready(self._sd_status())
                if not self._stopping:
                    self._reap_and_restart()
                    self._systemd_tick()
            self._shutdown(sel, rfd)
        finally:
            for slot in self._slots:  # never leave a worker behind, whatever happened
                if slot.proc is not None and slot.proc.poll() is None:
                    slot.proc.kill()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        slot.proc.wait(timeout=KILL_GRACE_S)
            signal.set_wakeup_fd(old_wakeup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._discovery.stop()
            sel.close()
            os.close(rfd)
            os.close(wfd)
            reserve.close()
            responses.close()
            if tenants is not None:
                tenants.close(unlink=True)
            if key_log is not None:
                key_log.close()
            stats.unlink()
            self._sd.close()
        return 1 if self._failed else 0

    def _create_key_log(self) -> KeyLogSegment | None:
        """The workers' shared prefix-key log (``{stats_name}.keys``); None when
        ``proxy.key_log_entries`` is 0 or it cannot be created (each worker's tables then
        count its own requests)."""
        entries = self.config.proxy.key_log_entries
        if not entries:
            return None
        try:
            return KeyLogSegment.create(key_log_name(self.stats_name), entries)
        except (TableError, OSError) as exc:
            logger.warning("no shared key log (%s): prefix tables are per worker", exc)
            return None

    def _create_tenant_block(self) -> TenantLimitBlock | None:
        """The workers' shared per-tenant counters (``{stats_name}.tenants``); None
        without tenants, or if it cannot be created (workers then count privately)."""
        if not self.config.tenants:
            return None
        n = min(len(self.config.tenants), MAX_TENANTS)
        try:
            return TenantLimitBlock.create(tenant_block_name(self.stats_name), n)
        except (TableError, OSError) as exc:
            logger.warning("no shared tenant counters (%s): tenant limits are per worker", exc)
            return None

    def _create_stats(self) -> StatsBlock:
        """The stats block: a slot per engine in force, room for ``proxy.max_engines``."""
        ids = [engine_id(e.name) for e in self._fleet_engines(self.config)]
        room = max(self.config.proxy.max_engines, len(ids))
        try:
            return StatsBlock.create(self.stats_name, ids, max_engines=room)
        except TableLockedError as exc:
            fallback = f"{self.stats_name}-{os.getpid()}"
            logger.warning("%s; this proxy uses stats block %r instead", exc, fallback)
            self.stats_name = fallback
            return StatsBlock.create(fallback, ids, max_engines=room)

    def _fleet_engines(self, config: Config) -> tuple[EngineConfig, ...]:
        """Every engine of the merged fleet (draining ones too: they keep their slot)."""
        try:
            merged = merge_fleet(config, read_state(self.state_path), str(self.state_path))
        except ConfigError as exc:
            logger.error("supervisor: engines state file unusable: %s", exc)
            return config.engines
        return tuple(entry.engine for entry in merged.entries)

    def _sync_stats(self) -> None:
        """Give stats slots to engines that joined (admin API, discovery) before the
        workers reload, so they count them in the shared block too."""
        ids = [engine_id(e.name) for e in self._fleet_engines(self.config)]
        if self._stats is None:
            return
        left_out = self._stats.add_engines(ids)
        if left_out:
            logger.warning(
                "stats block full (proxy.max_engines = %d): %d engines count per worker",
                self._stats.layout.max_engines,
                len(left_out),
            )

    def _start_discovery(self, config: Config) -> DiscoveryRunner:
        """Resolve ``[[discovery]]`` here, once per host; a change reloads like SIGHUP."""
        pid = os.getpid()
        runner = DiscoveryRunner(
            config.discovery, self.state_path, lambda: os.kill(pid, signal.SIGHUP)
        )
        runner.start()
        return runner

    @staticmethod
    def _wait_signals(sel: selectors.BaseSelector, rfd: int, timeout: float) -> list[int]:
        if not sel.select(timeout):
            return []
        try:
            data = os.read(rfd, 512)
        except BlockingIOError:
            return []
        return list(data)

    def _reload(self) -> None:
        try:
            config = load_config(self.config_path)
        except ConfigError as exc:
            logger.error("supervisor: reload: invalid config (workers keep theirs): %s", exc)
        else:
            if config.discovery != self.config.discovery:
                self._discovery.stop()
                self._discovery = self._start_discovery(config)
            self.config = config  # drain timeout; workers/address/stats need a restart
        self._sync_stats()
        logger.info("supervisor: SIGHUP, reloading the workers")
        for slot in self._slots:
            if slot.proc is not None and slot.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.send_signal(signal.SIGHUP)

    def _reap_and_restart(self) -> None:
        now = time.monotonic()
        for slot in self._slots:
            proc = slot.proc
            if proc is not None and proc.poll() is not None:
                logger.warning(
                    "worker %d (pid %d) exited with status %s",
                    slot.index,
                    proc.pid,
                    proc.returncode,
                )
                slot.proc = None
                while slot.restarts and slot.restarts[0] < now - RESTART_WINDOW_S:
                    slot.restarts.popleft()
                if len(slot.restarts) >= MAX_RESTARTS:
                    logger.error(
                        "worker %d died %d times in %.0f s: giving up, shutting down",
                        slot.index,
                        len(slot.restarts),
                        RESTART_WINDOW_S,
                    )
                    self._failed = self._stopping = True
                    return
                delay = min(MAX_RESTART_BACKOFF_S, RESTART_BACKOFF_S * 2 ** len(slot.restarts))
                slot.restarts.append(now)
                slot.restart_at = now + delay
                logger.info("worker %d restarts in %.1f s", slot.index, delay)
            if slot.proc is None and slot.restart_at is not None and now >= slot.restart_at:
                self._spawn(slot)

    def _tick_s(self) -> float:
        """The next wait: short while readiness or a restart is pending, else idle."""
        if (self._sd.enabled and not self._sd_ready) or any(s.proc is None for s in self._slots):
            return _TICK_S
        return _IDLE_TICK_S

    def _systemd_tick(self) -> None:
        """sd_notify: READY=1 once every worker listens on the port, then STATUS= changes."""
        if not self._sd.enabled:
            return
        self._sd.keepalive()
        if self._sd_ready:
            self._sd.status(self._sd_status())
            return
        live = [s.proc.pid for s in self._slots if s.proc is not None and s.proc.poll() is None]
        listening = pids_listening(live, self.port)  # None: no /proc/net, trust "alive"
        if len(live) == self.workers and (listening is None or len(listening) == self.workers):
            self._sd_ready = True
            self._sd.ready(self._sd_status())

    def _sd_status(self) -> str:
        live = sum(1 for s in self._slots if s.proc is not None and s.proc.poll() is None)
        return f"{live}/{self.workers} workers running on {self.host}:{self.port}"

    def _shutdown(self, sel: selectors.BaseSelector, rfd: int) -> None:
        self._sd.stopping(
            "draining workers",
            extend_timeout_s=self.config.proxy.drain_timeout_s + 3 * KILL_GRACE_S,
        )
        live = [s.proc for s in self._slots if s.proc is not None and s.proc.poll() is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.proxy.drain_timeout_s + KILL_GRACE_S
        while any(p.poll() is None for p in live):
            left = deadline - time.monotonic()
            if left <= 0:
                for proc in live:
                    if proc.poll() is None:
                        logger.warning("worker pid %d did not drain in time: killed", proc.pid)
                        proc.kill()
                        self._failed = True
                break
            self._wait_signals(sel, rfd, min(_TICK_S, left))  # SIGCHLD wakes us early
        for proc in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=KILL_GRACE_S)
            if proc.returncode not in (0, -signal.SIGTERM):
                self._failed = True
        logger.info("supervisor: all workers exited")


def worker_parent_alive(supervisor_pid: int) -> bool:
    """Whether this worker's parent is still ``supervisor_pid`` (call after
    :func:`set_parent_death_signal`, which does not fire for an already-dead parent)."""
    return os.getppid() == supervisor_pid


def config_path_of(path: str) -> Path:
    """The absolute config path (workers may run with another working directory)."""
    return Path(path).resolve()
