"""The load driver: play chat sessions turn by turn against OpenAI-compatible URLs.

A session's turns are sequential: turn k+1 is sent ``think_s`` after the reply to
turn k finished, and its messages carry the real reply texts of the earlier turns
(so an engine's prefix cache sees what a real conversation would give it). A turn
that fails ends its session (a client without the reply cannot continue the
conversation).

Arrival modes
-------------
* **open loop** (``concurrency=None``): each session starts at its ``start_s``
  (seconds after the run starts), whatever the servers' state — the offered load
  does not adapt to the latency, as with real users;
* **closed loop** (``concurrency=N``): N sessions at a time, the next one starting
  when one ends, ``start_s`` ignored.

Bounds
------
``max_in_flight`` requests at once (a request waits for a slot; the wait is
recorded as ``queued_s``), ``max_live_sessions`` sessions at once in open loop
(later ones are dropped and counted), ``duration_s`` after which no request is sent
and ``drain_s`` after which requests still in flight are cancelled (recorded with
error ``deadline``), ``max_requests`` requests in all, ``request_timeout_s`` per
request. :meth:`LoadDriver.stop` ends the run early the same way as the deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import msgspec

from fastroute.loadgen.client import send_chat
from fastroute.loadgen.records import RequestRecord

__all__ = ["DriveOptions", "DriveResult", "LoadDriver", "SessionLike", "TurnLike"]


class TurnLike(Protocol):
    """What the driver reads of a turn (``fastroute.workload.Turn``)."""

    @property
    def max_tokens(self) -> int: ...

    @property
    def think_s(self) -> float: ...


class SessionLike(Protocol):
    """What the driver reads of a session (``fastroute.workload.Session``)."""

    @property
    def session_id(self) -> str: ...

    @property
    def tenant(self) -> str: ...

    @property
    def source(self) -> str: ...

    @property
    def model(self) -> str: ...

    @property
    def start_s(self) -> float: ...

    @property
    def turns(self) -> Sequence[Any]: ...

    def messages(self, turn: int, replies: Sequence[str]) -> list[dict[str, Any]]: ...


@dataclass(frozen=True)
class DriveOptions:
    """How the driver sends and bounds its traffic (see the module doc).

    Attributes
    ----------
    stream : bool
        Ask for SSE streaming (``stream_options.include_usage`` too).
    send_session_id : bool
        Send the session id in ``session_header``; off, routers must key on the
        conversation itself.
    session_header : str
        Header name of the session id.
    ignore_eos : bool
        Send ``ignore_eos: true`` so engines generate exactly ``max_tokens`` (the
        workload, not the engine, fixes output lengths; vLLM and the emulator honour it).
    concurrency : int or None
        Closed loop with this many concurrent sessions; None for open loop.
    max_in_flight : int
        Requests in flight at once.
    max_live_sessions : int
        Open loop: sessions in progress at once; later arrivals are dropped.
    duration_s : float or None
        No request is sent after this many seconds.
    drain_s : float
        After ``duration_s`` (or :meth:`LoadDriver.stop`), how long requests in flight
        may finish before they are cancelled.
    max_requests : int or None
        Requests sent in all.
    request_timeout_s : float
        Per-request total timeout.
    connect_timeout_s : float
        Per-request TCP connect timeout.
    """

    stream: bool = True
    send_session_id: bool = False
    session_header: str = "x-session-id"
    ignore_eos: bool = True
    concurrency: int | None = None
    max_in_flight: int = 256
    max_live_sessions: int = 10_000
    duration_s: float | None = None
    drain_s: float = 30.0
    max_requests: int | None = None
    request_timeout_s: float = 120.0
    connect_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1 or None, got {self.concurrency}")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.max_live_sessions < 1:
            raise ValueError(f"max_live_sessions must be >= 1, got {self.max_live_sessions}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0 or None, got {self.duration_s}")
        if not self.drain_s >= 0:
            raise ValueError(f"drain_s must be >= 0, got {self.drain_s}")
        if self.max_requests is not None and self.max_requests < 0:
            raise ValueError(f"max_requests must be >= 0 or None, got {self.max_requests}")
        if not self.request_timeout_s > 0 or not self.connect_timeout_s > 0:
            raise ValueError("request_timeout_s and connect_timeout_s must be > 0")


@dataclass
class DriveResult:
    """What a run produced.

    Attributes
    ----------
    records : list of RequestRecord
        One per request sent, in completion order.
    started_at : float
        Unix time at the start of the run.
    wall_s : float
        Run length, seconds (until the last request ended).
    sessions_started, sessions_completed, sessions_dropped : int
        Sessions begun, played to their last turn, and dropped at arrival because
        ``max_live_sessions`` were in progress.
    stopped_early : bool
        The run ended through :meth:`LoadDriver.stop`.
    """

    records: list[RequestRecord] = field(default_factory=list)
    started_at: float = 0.0
    wall_s: float = 0.0
    sessions_started: int = 0
    sessions_completed: int = 0
    sessions_dropped: int = 0
    stopped_early: bool = False


def _chat_urls(source: str, bases: str | Sequence[str]) -> tuple[str, ...]:
    urls = (bases,) if isinstance(bases, str) else tuple(bases)
    if not urls:
        raise ValueError(f"source {source!r} has an empty list of target URLs")
    return tuple(u.rstrip("/") + "/v1/chat/completions" for u in urls)


class LoadDriver:
    """Plays sessions against the base URLs of each source cluster.

    Parameters
    ----------
    targets : str or mapping of str to str or sequence of str
        Base URL (``http://host:port``, no ``/v1``) for every source, or a mapping
        source → base URL(s); the key ``"*"`` is the fallback for other sources. A
        source with several URLs (several proxies behind a stateless balancer) sends
        its requests to them in turn, request by request, so consecutive turns of one
        session can land on different proxies.
    options : DriveOptions
    on_record : callable, optional
        Called with each finished record (e.g. live progress), on the event loop.

    Examples
    --------
    >>> driver = LoadDriver("http://127.0.0.1:8080", DriveOptions(duration_s=10))  # doctest: +SKIP
    >>> result = await driver.run(sessions)                                        # doctest: +SKIP
    """

    def __init__(
        self,
        targets: str | Mapping[str, str | Sequence[str]],
        options: DriveOptions | None = None,
        *,
        on_record: Callable[[RequestRecord], None] | None = None,
    ) -> None:
        self.options = options or DriveOptions()
        if isinstance(targets, str):
            targets = {"*": targets}
        if not targets:
            raise ValueError("targets must name at least one base URL")
        self._urls = {k: _chat_urls(k, v) for k, v in targets.items()}
        self._turn = dict.fromkeys(self._urls, 0)
        self._on_record = on_record
        self._stop = asyncio.Event()
        self._stopped_by_user = False
        self._sent = 0
        self._result = DriveResult()
        self._t0 = 0.0
        self._slots: asyncio.Semaphore | None = None
        self._http: aiohttp.ClientSession | None = None
        self._encoder = msgspec.json.Encoder()

    def _key(self, source: str) -> str:
        if source in self._urls:
            return source
        if "*" in self._urls:
            return "*"
        raise KeyError(
            f"no target URL for source cluster {source!r}; targets: {sorted(self._urls)}"
        )

    def url_for(self, source: str) -> str:
        """The chat-completions URL the next request from ``source`` goes to."""
        key = self._key(source)
        urls = self._urls[key]
        turn = self._turn[key]
        self._turn[key] = turn + 1
        return urls[turn % len(urls)]

    def stop(self) -> None:
        """End the run as at the deadline: no new requests, then drain."""
        self._stopped_by_user = True
        self._stop.set()

    @property
    def requests_sent(self) -> int:
        """Requests sent so far."""
        return self._sent

    async def run(self, sessions: Iterable[SessionLike]) -> DriveResult:
        """Play ``sessions`` (sorted by ``start_s`` for open loop) until done or bounded.

        Raises
        ------
        KeyError
            A session's source has no target URL (checked before anything is sent).
        """
        sessions = list(sessions)
        for s in sessions:
            self._key(s.source)
        opts = self.options
        self._result = DriveResult(started_at=time.time())
        self._slots = asyncio.Semaphore(opts.max_in_flight)
        connector = aiohttp.TCPConnector(limit=opts.max_in_flight, limit_per_host=0)
        timeout = aiohttp.ClientTimeout(
            total=opts.request_timeout_s, sock_connect=opts.connect_timeout_s
        )
        self._t0 = time.perf_counter()
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False
        ) as http:
            self._http = http
            tasks: set[asyncio.Task[None]] = set()
            deadline = asyncio.get_running_loop().create_task(self._deadline())
            try:
                if opts.concurrency is None:
                    await self._open_loop(sessions, tasks)
                else:
                    await self._closed_loop(sessions, tasks)
                await self._drain(tasks)
            finally:
                deadline.cancel()
                for task in tasks:
                    task.cancel()
                if tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)
            self._http = None
        self._result.wall_s = time.perf_counter() - self._t0
        self._result.stopped_early = self._stopped_by_user
        return self._result

    # -- scheduling ------------------------------------------------------------------------------
    async def _deadline(self) -> None:
        if self.options.duration_s is not None:
            await asyncio.sleep(self.options.duration_s)
            self._stop.set()

    def _exhausted(self) -> bool:
        cap = self.options.max_requests
        return self._stop.is_set() or (cap is not None and self._sent >= cap)

    async def _sleep_or_stop(self, delay_s: float) -> bool:
        """Sleep ``delay_s``; return False if the run stopped meanwhile."""
        if delay_s > 0:
            try:
                await asyncio.wait_for(self._stop.wait(), delay_s)
            except TimeoutError:
                pass
        return not self._exhausted()

    async def _open_loop(self, sessions: list[SessionLike], tasks: set[asyncio.Task[None]]) -> None:
        limit = self.options.max_live_sessions
        for session in sorted(sessions, key=lambda s: s.start_s):
            delay = self._t0 + session.start_s - time.perf_counter()
            if not await self._sleep_or_stop(delay):
                return
            if len(tasks) >= limit:
                self._result.sessions_dropped += 1
                continue
            task = asyncio.create_task(self._play(session))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def _closed_loop(
        self, sessions: list[SessionLike], tasks: set[asyncio.Task[None]]
    ) -> None:
        queue = iter(sessions)

        async def worker() -> None:
            for session in queue:
                if self._exhausted():
                    return
                await self._play(session)

        n = self.options.concurrency or 1
        for _ in range(n):
            task = asyncio.create_task(worker())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        # Wait for the workers unless the deadline/stop comes first; _drain bounds the rest.
        await self._wait_unless_stopped(tasks)

    async def _wait_unless_stopped(self, tasks: set[asyncio.Task[None]]) -> None:
        """Until every task in ``tasks`` is done or :meth:`stop` (or the deadline) is called."""
        stop = asyncio.create_task(self._stop.wait())
        try:
            pending: set[asyncio.Task[Any]] = set(tasks)
            while pending and not self._stop.is_set():
                _, pending = await asyncio.wait(
                    pending | {stop}, return_when=asyncio.FIRST_COMPLETED
                )
                pending.discard(stop)
        finally:
            stop.cancel()

    async def _drain(self, tasks: set[asyncio.Task[None]]) -> None:
        if not tasks:
            return
        if not self._stop.is_set():
            # Natural end: wait for the sessions in progress, until the deadline stops them.
            await self._wait_unless_stopped(tasks)
        if tasks:
            await asyncio.wait(set(tasks), timeout=self.options.drain_s)

    # -- one session -----------------------------------------------------------------------------
    async def _play(self, session: SessionLike) -> None:
        self._result.sessions_started += 1
        replies: list[str] = []
        turns = session.turns
        for index, turn in enumerate(turns):
            if index > 0 and not await self._sleep_or_stop(turn.think_s):
                return
            if self._exhausted():
                return
            url = self.url_for(session.source)
            text = await self._request(session, index, turn, url, replies)
            if text is None:
                return
            replies.append(text)
        self._result.sessions_completed += 1

    async def _request(
        self, session: SessionLike, index: int, turn: TurnLike, url: str, replies: list[str]
    ) -> str | None:
        opts = self.options
        assert self._slots is not None and self._http is not None
        body: dict[str, Any] = {
            "model": session.model,
            "messages": session.messages(index, replies),
            "max_tokens": turn.max_tokens,
            "stream": opts.stream,
        }
        if opts.stream:
            body["stream_options"] = {"include_usage": True}
        if opts.ignore_eos:
            body["ignore_eos"] = True
        headers = {opts.session_header: session.session_id} if opts.send_session_id else None
        record = RequestRecord(
            session_id=session.session_id,
            tenant=session.tenant,
            source=session.source,
            model=session.model,
            turn=index,
            sent_at_s=time.perf_counter() - self._t0,
            stream=opts.stream,
        )
        t_wait = time.perf_counter()
        async with self._slots:
            if self._exhausted():
                return None
            self._sent += 1
            record.queued_s = time.perf_counter() - t_wait
            try:
                reply = await send_chat(
                    self._http, url, self._encoder.encode(body), record,
                    headers=headers, t0=self._t0,
                )  # fmt: skip
            finally:
                self._result.records.append(record)
                if self._on_record is not None:
                    self._on_record(record)
        return reply.text if record.ok else None
