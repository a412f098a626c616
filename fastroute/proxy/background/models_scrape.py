"""What the engines serve, from their own ``GET /v1/models``: the proxy's model list.

:class:`ModelsScraper` asks every configured engine's ``/v1/models`` every
``proxy.models_scrape_interval_s``, the first time :data:`FIRST_ROUND_DELAY_S` after start
(all engines at once, at most
:data:`MAX_CONCURRENT_SCRAPES`, each bounded by ``proxy.scrape_timeout_s`` and
:data:`MAX_MODELS_BYTES`) and keeps each engine's answer in a :class:`ModelCatalog`. The
catalog answers ``GET /v1/models``: the union of the engines' model cards (``id``,
``owned_by``, ``root``, ``parent``, ``max_model_len``; a LoRA adapter is its own id with
its base model as ``parent``), one card per id (the smallest ``max_model_len`` when engines
differ). An engine that has not answered yet, or answers without a model list (404, not
JSON), counts as serving what the config says it does (its ``models``, ``owned_by
"fastroute"``); an engine that answered once keeps its last list while it is unreachable.

A model the config names that no engine serves is *unserved*: ``/ready`` names them
(503 only when nothing is served) and each change of the set is logged once.

Routing does not read the catalog: which engines serve a model is the config's
``engines[].models``. Routing LoRA adapters by the scraped list would need the adapters in
the fleet's class rows (rows are built from the config), a weight per adapter row from the
controller, and a way to add rows on a running fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
import msgspec

from fastroute.config import Config, EngineConfig
from fastroute.signals.body import read_bounded

__all__ = [
    "ModelCard",
    "ModelCatalog",
    "ModelsScraper",
    "parse_models",
    "models_body",
    "MAX_MODELS_BYTES",
    "MAX_CONCURRENT_SCRAPES",
    "FALLBACK_OWNER",
    "FIRST_ROUND_DELAY_S",
]

logger = logging.getLogger(__name__)

#: Largest ``/v1/models`` body read.
MAX_MODELS_BYTES = 1024 * 1024
#: Engines asked at once.
MAX_CONCURRENT_SCRAPES = 16
#: Seconds from a worker's start to its first round: the config's list serves meanwhile, and
#: the engines are not asked while the fleet is still starting (or being set up by a test).
FIRST_ROUND_DELAY_S = 1.0
#: ``owned_by`` of a model card taken from the config (no engine answered for it).
FALLBACK_OWNER = "fastroute"


class ModelCard(msgspec.Struct, frozen=True):
    """One entry of an engine's model list (vLLM's ``ModelCard``, the fields kept)."""

    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = FALLBACK_OWNER
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class _ModelList(msgspec.Struct):
    data: list[ModelCard]


_list_decoder = msgspec.json.Decoder(_ModelList)


def parse_models(body: bytes) -> list[ModelCard]:
    """The cards of an OpenAI ``/v1/models`` list body.

    Raises
    ------
    msgspec.DecodeError
        Not a model list.
    """
    return _list_decoder.decode(body).data


class ModelCatalog:
    """Each engine's last model list, and what they add up to (see the module doc)."""

    def __init__(self) -> None:
        self._by_engine: dict[str, list[ModelCard]] = {}
        self._unserved: tuple[str, ...] | None = None

    def update(self, engine: str, cards: list[ModelCard] | None) -> None:
        """Keep ``engine``'s answer; None: it has no model list (use the config's)."""
        if cards is None:
            self._by_engine.pop(engine, None)
        else:
            self._by_engine[engine] = cards

    def answered(self, engine: str) -> bool:
        """``engine`` has reported its own model list."""
        return engine in self._by_engine

    def _engine_cards(self, engine: EngineConfig, created: int) -> list[ModelCard]:
        cards = self._by_engine.get(engine.name)
        if cards is None:
            return [ModelCard(id=m, created=created) for m in engine.models]
        return cards

    def cards(self, config: Config) -> list[ModelCard]:
        """The union over ``config``'s engines, one card per id, sorted by id."""
        created = int(time.time())
        out: dict[str, ModelCard] = {}
        for engine in config.engines:
            for card in self._engine_cards(engine, created):
                seen = out.get(card.id)
                if seen is None:
                    out[card.id] = card
                elif card.max_model_len is not None and (
                    seen.max_model_len is None or card.max_model_len < seen.max_model_len
                ):
                    out[card.id] = msgspec.structs.replace(seen, max_model_len=card.max_model_len)
        return [out[k] for k in sorted(out)]

    def unserved(self, config: Config) -> list[str]:
        """The models ``config`` names that no engine serves, sorted."""
        served: set[str] = set()
        for engine in config.engines:
            cards = self._by_engine.get(engine.name)
            served.update(engine.models if cards is None else (c.id for c in cards))
        return sorted(set(config.models()) - served)

    def note_unserved(self, config: Config) -> list[str]:
        """:meth:`unserved`, logged once per change of the set."""
        now = tuple(self.unserved(config))
        if now != self._unserved:
            if now:
                logger.warning(
                    "models the config names but no engine serves (per their /v1/models): %s",
                    ", ".join(now),
                )
            elif self._unserved:
                logger.info("every model the config names is served again")
            self._unserved = now
        return list(now)


class ModelsScraper:
    """Ask every engine's ``GET /v1/models`` in rounds, into a :class:`ModelCatalog`.

    Parameters
    ----------
    catalog : ModelCatalog
    config : callable
        Returns the config in force (its engines, interval and timeout are read each round,
        so a reload takes effect at the next one).
    """

    def __init__(self, catalog: ModelCatalog, config: Callable[[], Config]) -> None:
        self.catalog = catalog
        self._config = config
        self.rounds_total = 0
        self.errors_total: dict[str, int] = {}
        self._session: aiohttp.ClientSession | None = None

    async def _ask(self, engine: EngineConfig, sem: asyncio.Semaphore, timeout_s: float) -> None:
        assert self._session is not None
        headers = {"Authorization": f"Bearer {engine.api_key}"} if engine.api_key else {}
        try:
            async with sem, asyncio.timeout(timeout_s):
                async with self._session.get(engine.url + "/v1/models", headers=headers) as resp:
                    status, body = resp.status, await read_bounded(resp.content, MAX_MODELS_BYTES)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            # Unreachable: keep the last list (or the config's), count it.
            self.errors_total[engine.name] = self.errors_total.get(engine.name, 0) + 1
            logger.debug("GET /v1/models of engine %s failed: %r", engine.name, exc)
            return
        cards: list[ModelCard] | None = None
        if status == 200 and len(body) <= MAX_MODELS_BYTES:
            with contextlib.suppress(msgspec.DecodeError):
                cards = parse_models(body)
        self.catalog.update(engine.name, cards)

    async def scrape_once(self) -> list[str]:
        """One round over the config's engines; returns the unserved models."""
        config = self._config()
        if self._session is None:
            # One request per engine per round, seconds apart: no idle keep-alive connections
            # left open on the engines between rounds.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        sem = asyncio.Semaphore(MAX_CONCURRENT_SCRAPES)
        timeout_s = config.proxy.scrape_timeout_s
        await asyncio.gather(*(self._ask(e, sem, timeout_s) for e in config.engines))
        self.rounds_total += 1
        return self.catalog.note_unserved(config)

    async def run(self) -> None:
        """Scrape every ``proxy.models_scrape_interval_s`` (the first round after
        :data:`FIRST_ROUND_DELAY_S`) until cancelled."""
        try:
            await asyncio.sleep(FIRST_ROUND_DELAY_S)
            while True:
                started = time.monotonic()
                await self.scrape_once()
                interval_s = self._config().proxy.models_scrape_interval_s
                await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))
        finally:
            if self._session is not None:
                await self._session.close()
                self._session = None


def models_body(cards: Sequence[ModelCard]) -> dict[str, Any]:
    """The OpenAI list body of ``cards``."""
    return {"object": "list", "data": [msgspec.to_builtins(c) for c in cards]}
