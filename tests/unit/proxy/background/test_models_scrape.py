"""The model catalog: the engines' own lists, their union and the config's fallback."""

from __future__ import annotations

import logging

import msgspec
import pytest

from fastroute.config import Config, decode_config
from fastroute.proxy.background.models_scrape import (
    FALLBACK_OWNER,
    ModelCard,
    ModelCatalog,
    models_body,
    parse_models,
)

VLLM_LIST = (
    b'{"object":"list","data":[{"id":"base","object":"model","created":1,"owned_by":"vllm",'
    b'"root":"base","parent":null,"max_model_len":4096,"permission":[{"id":"p"}]},'
    b'{"id":"lora-a","object":"model","created":1,"owned_by":"vllm","root":"/a",'
    b'"parent":"base","max_model_len":4096,"permission":[]}]}'
)


def _config() -> Config:
    toml = (
        '[[engines]]\nname = "e0"\nurl = "http://127.0.0.1:1"\nmodels = ["base"]\n'
        '[[engines]]\nname = "e1"\nurl = "http://127.0.0.1:2"\nmodels = ["base", "other"]\n'
    )
    return decode_config(toml, source="t.toml")


def test_parse_vllm_list_keeps_the_card_fields() -> None:
    cards = parse_models(VLLM_LIST)
    assert [c.id for c in cards] == ["base", "lora-a"]
    assert cards[1].parent == "base" and cards[1].root == "/a"
    assert cards[0].max_model_len == 4096 and cards[0].owned_by == "vllm"
    with pytest.raises(msgspec.DecodeError):
        parse_models(b'{"detail": "Not Found"}')


def test_before_any_answer_the_config_is_the_list() -> None:
    catalog, config = ModelCatalog(), _config()
    cards = catalog.cards(config)
    assert [(c.id, c.owned_by) for c in cards] == [
        ("base", FALLBACK_OWNER),
        ("other", FALLBACK_OWNER),
    ]
    assert catalog.unserved(config) == []
    body = models_body(cards)
    assert body["object"] == "list" and body["data"][0]["object"] == "model"


def test_union_with_lora_smallest_context_and_unserved() -> None:
    catalog, config = ModelCatalog(), _config()
    catalog.update("e0", parse_models(VLLM_LIST))
    catalog.update("e1", [ModelCard(id="base", owned_by="vllm", max_model_len=2048)])
    cards = {c.id: c for c in catalog.cards(config)}
    assert set(cards) == {"base", "lora-a"}
    assert cards["base"].max_model_len == 2048  # what every engine can hold
    assert cards["lora-a"].parent == "base"
    assert catalog.unserved(config) == ["other"]
    catalog.update("e1", None)  # e1 has no model list after all: the config's word for it
    assert catalog.unserved(config) == []
    assert not catalog.answered("e1") and catalog.answered("e0")


def test_unserved_is_logged_once_per_change(caplog: pytest.LogCaptureFixture) -> None:
    catalog, config = ModelCatalog(), _config()
    catalog.update("e0", [ModelCard(id="base")])
    catalog.update("e1", [ModelCard(id="base")])
    with caplog.at_level(logging.INFO, logger="fastroute.proxy.background.models_scrape"):
        assert catalog.note_unserved(config) == ["other"]
        assert catalog.note_unserved(config) == ["other"]
        catalog.update("e1", [ModelCard(id="other")])
        assert catalog.note_unserved(config) == []
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "other" in messages[0] and "served again" in messages[1]
