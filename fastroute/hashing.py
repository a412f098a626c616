"""Stable key hashing for routing.

Routing keys must hash identically in every worker process and on every host, so
fastroute never uses Python's per-process salted ``hash()``. Keys are hashed with
xxh3-64 (seed 0); ``str`` keys are encoded as UTF-8 first.
"""

from __future__ import annotations

from xxhash import xxh3_64_intdigest

__all__ = ["PROMPT_KEY_PREFIX_BYTES", "key_hash", "engine_id", "class_key"]

#: Bytes of a completion prompt's text that form its routing key
#: (:mod:`fastroute.proxy.path.routing_key`; the simulator keys completions the same way):
#: 1 KiB ≈ 256 tokens ≈ 16 vLLM KV blocks, long enough to tell prompts apart, short enough
#: that prompts built on one template prefix share an engine (and its prefix cache).
PROMPT_KEY_PREFIX_BYTES = 1024


def key_hash(data: bytes | bytearray | memoryview | str) -> int:
    """Return the 64-bit xxh3 hash of a routing key.

    Parameters
    ----------
    data : bytes, bytearray, memoryview or str
        The key. ``str`` is encoded as UTF-8.

    Returns
    -------
    int
        An unsigned 64-bit integer, the same in every process and on every host.
    """
    if isinstance(data, str):
        data = data.encode("utf-8")
    elif not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"key_hash() takes bytes or str, not {type(data).__name__}")
    return xxh3_64_intdigest(data)


def engine_id(name: str) -> int:
    """Return the stable 64-bit id of an engine named ``name`` (its :func:`key_hash`)."""
    return key_hash(name)


def class_key(cluster: str, model: str, priority: str) -> int:
    """The weight-table row key of the request class ``(cluster, model, priority)``.

    xxh3-64 of ``"\\0class\\0{cluster}\\0{model}\\0{priority}"``. The controller publishes
    rows under these keys and the proxy looks its classes up by them, so both call this.
    Residency zones are not part of the key: the proxy applies them per request.
    """
    return key_hash(f"\0class\0{cluster}\0{model}\0{priority}")
