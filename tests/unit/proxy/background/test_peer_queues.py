"""The peer-queue poller against stub peers: sums, names it does not know, bad answers,
the peers' key-log entries."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import numpy as np
from aiohttp import web

from fastroute import _core
from fastroute.config import decode_config
from fastroute.policy.key_exchange import SINCE_HEADER, KeyExchange
from fastroute.policy.prefix_hrw import private_key_log
from fastroute.proxy.background.peer_queues import MAX_ANSWER_BYTES, PeerQueues
from fastroute.proxy.path.fleet import Fleet
from fastroute.tables.stats import StatsBlock
from fastroute.testing.servers import serve_app


def _fleet(block: StatsBlock | None = None) -> Fleet:
    toml = "".join(
        f'[[engines]]\nname = "e{i}"\nurl = "http://127.0.0.1:{i + 1}"\nmodels = ["m"]\n'
        for i in range(3)
    )
    toml += '[proxy]\npeers = ["http://127.0.0.1:9"]\n'
    return Fleet(decode_config(toml, source="t.toml"), stats_block=block)


def _ids(fleet: Fleet) -> list[int]:
    return [int(i) for i in fleet.engine_ids]


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _serve(stack: contextlib.AsyncExitStack, handlers: list[Handler]) -> list[str]:
    """Serve each handler as ``GET /admin/queue`` of its own stub peer; their URLs."""
    urls = []
    for handler in handlers:
        app = web.Application()
        app.router.add_get("/admin/queue", handler)
        urls.append(await stack.enter_async_context(serve_app(app)))
    return urls


def _answer(engines: dict[str, int]) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        assert request.headers.get("Authorization") == "Bearer " + "k" * 16
        return web.json_response({"engines": engines})

    return handler


def test_the_peers_answers_are_summed_per_engine_and_bad_ones_count_as_none() -> None:
    async def main() -> None:
        async def broken(_: web.Request) -> web.StreamResponse:
            return web.Response(status=500, text="no")

        async def garbage(_: web.Request) -> web.StreamResponse:
            return web.Response(body=b'{"engines": [1, 2]}', content_type="application/json")

        async def huge(_: web.Request) -> web.StreamResponse:
            return web.Response(body=b" " * (MAX_ANSWER_BYTES + 10))

        async def slow(_: web.Request) -> web.StreamResponse:
            await asyncio.sleep(3.0)  # past the 1 s floor of the poll's timeout
            return web.json_response({"engines": {"e0": 1}})

        handlers = [
            _answer({"e0": 100, "e2": 7, "elsewhere": 5000, "e1": -4}),
            _answer({"e0": 50}),
            broken,
            garbage,
            huge,
            slow,
        ]
        stack = contextlib.AsyncExitStack()
        urls = await _serve(stack, handlers)
        fleet = _fleet()
        poller = PeerQueues(urls, lambda: fleet, interval_s=0.2, admin_token="k" * 16)
        try:
            assert fleet.stats.peer_queued().tolist() == [0, 0, 0]
            await poller.poll_once()
            # Names the fleet lacks and negative counts are ignored.
            assert fleet.stats.peer_queued().tolist() == [150, 0, 7]
            # The request path reads them with this host's own queue (none here).
            assert fleet.stats.queued_tokens().tolist() == [150, 0, 7]
            assert fleet.stats.own_queued_tokens().tolist() == [0, 0, 0]
            assert poller.queued_tokens_total() == 157 and poller.active
            assert [p.ok_total for p in poller.peers] == [1, 1, 0, 0, 0, 0]
            assert [p.failed_total for p in poller.peers] == [0, 0, 1, 1, 1, 1]
            assert "HTTP 500" in (poller.peers[2].last_error or "")
            assert "larger than" in (poller.peers[4].last_error or "")
            assert "Timeout" in (poller.peers[5].last_error or "")
            # A reload's new fleet gets the next round's figures.
            reloaded = _fleet()
            poller.fleet = lambda: reloaded
            await poller.poll_once()
            assert reloaded.stats.peer_queued().tolist() == [150, 0, 7]
            assert poller.rounds_total == 2
        finally:
            poller.release()
            await stack.aclose()

    asyncio.run(asyncio.wait_for(main(), 20.0))


def test_one_worker_per_host_polls_and_every_worker_reads_its_figures(shm_name: str) -> None:
    async def main() -> None:
        stack = contextlib.AsyncExitStack()
        urls = await _serve(stack, [_answer({"e1": 300})])
        block = StatsBlock.create(shm_name, _ids(_fleet()))
        workers = [_fleet(StatsBlock.attach(shm_name)) for _ in range(3)]
        pollers = [
            PeerQueues(urls, lambda f=f: f, interval_s=0.2, admin_token="k" * 16) for f in workers
        ]
        try:
            for poller in pollers:
                await poller.poll_once()
            assert [p.active for p in pollers] == [True, False, False]
            assert [p.rounds_total for p in pollers] == [1, 0, 0]
            assert [f.stats.peer_queued().tolist() for f in workers] == [[0, 300, 0]] * 3
            view = workers[2].view(np.ones(3, dtype=bool))
            workers[2].stats.add_queued(1, 20)  # this host's own queue adds to the peers'
            assert view.queued_tokens().tolist() == [0, 320, 0]
            assert workers[0].stats.own_queued_tokens().tolist() == [0, 20, 0]
            # The poller goes away (its worker exits): the peers' figures leave the host's
            # counts until the next worker to try takes over.
            pollers[0].release()
            assert workers[1].stats.queued_tokens().tolist() == [0, 20, 0]
            await pollers[1].poll_once()
            assert [p.active for p in pollers] == [False, True, False]
            assert workers[0].stats.peer_queued().tolist() == [0, 300, 0]
        finally:
            for poller in pollers:
                poller.release()
            await stack.aclose()
            for f in workers:
                assert f.stats.block is not None
                f.stats.block.close()
            block.close()

    asyncio.run(asyncio.wait_for(main(), 20.0))


def test_the_peers_key_log_entries_go_into_the_hosts_log_from_where_the_last_poll_ended() -> None:
    async def main() -> None:
        asked: list[str | None] = []
        fail_next = [False]

        async def with_keys(request: web.Request) -> web.StreamResponse:
            since = request.headers.get(SINCE_HEADER)
            asked.append(since)
            if fail_next[0]:
                fail_next[0] = False
                return web.Response(status=503)
            start = 0 if since == "-1" else int(since or 0)
            entries = [[0, 1, [1000 + i]] for i in range(start, start + 2)]
            return web.json_response(
                {"engines": {}, "key_log": [start + 2, ["proxy:prefix-hrw"], entries]}
            )

        async def without_keys(_: web.Request) -> web.StreamResponse:  # an older peer
            return web.json_response({"engines": {"e0": 3}})

        stack = contextlib.AsyncExitStack()
        urls = await _serve(stack, [with_keys, without_keys])
        fleet = _fleet()
        log = private_key_log(64)
        exchange = KeyExchange(log, ("proxy:prefix-hrw",))
        reader = _core.KeyLog(log, 7, 0)
        poller = PeerQueues(urls, lambda: fleet, interval_s=0.2, key_exchange=lambda: exchange)
        hot, seen = _core.HotKeys(1e9), _core.HotKeys(1e9)
        try:
            await poller.poll_once()
            fail_next[0] = True
            await poller.poll_once()  # failed: the position is kept
            await poller.poll_once()
            assert asked == ["-1", "2", "2"]
            assert reader.drain(hot, seen) == 4
            assert [seen.share(1000 + i) > 0 for i in range(5)] == [True] * 4 + [False]
            keyed, older = poller.peers
            assert (keyed.keys_imported_total, keyed.key_cursor) == (4, 4)
            assert (older.keys_imported_total, older.ok_total) == (0, 3)
            assert fleet.stats.peer_queued().tolist() == [3, 0, 0]
            poller.key_exchange = lambda: None  # no key log (a reload switched it off)
            await poller.poll_once()
            assert asked[-1] is None
        finally:
            poller.release()
            await stack.aclose()

    asyncio.run(asyncio.wait_for(main(), 20.0))


def test_each_peer_is_polled_on_its_own_cadence_so_a_slow_one_holds_back_no_other() -> None:
    """``run``: a peer answering in 0.8 s (a distant one, within the 1 s timeout floor)
    does not slow the polls of a prompt one, whose figures reach the host's stats after
    each of its own answers."""

    async def main() -> None:
        async def distant(_: web.Request) -> web.StreamResponse:
            await asyncio.sleep(0.8)
            return web.json_response({"engines": {"e2": 9}})

        stack = contextlib.AsyncExitStack()
        urls = await _serve(stack, [_answer({"e0": 40}), distant])
        fleet = _fleet()
        poller = PeerQueues(urls, lambda: fleet, interval_s=0.05, admin_token="k" * 16)
        prompt, slow = poller.peers
        task = asyncio.create_task(poller.run())
        try:
            deadline = asyncio.get_running_loop().time() + 5.0
            while prompt.ok_total < 4 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            # four answers of the prompt peer (0.15 s at 0.05 s) before the distant one's
            assert prompt.ok_total >= 4 and slow.ok_total == 0 and slow.failed_total == 0
            assert fleet.stats.peer_queued().tolist() == [40, 0, 0]
            while slow.ok_total == 0 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            assert slow.ok_total == 1 and slow.failed_total == 0
            assert fleet.stats.peer_queued().tolist() == [40, 0, 9]
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await stack.aclose()

    asyncio.run(asyncio.wait_for(main(), 20.0))
