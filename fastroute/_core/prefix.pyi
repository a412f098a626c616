from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fastroute._core.selector import Selector

def depth_keys(prefix: bytes, block_bytes: int) -> list[tuple[int, int]]: ...

class HotKeys:
    """Exponentially decayed per-key shares of the observed token weight (compiled)."""

    def __init__(self, half_life_requests: float, max_keys: int = ...) -> None: ...
    @property
    def requests(self) -> int:
        """Requests observed so far (the logical clock)."""
    def __len__(self) -> int: ...
    def observe(self, keys: Sequence[int], weight: float, engine_id: int = 0) -> None: ...
    def set_half_life(self, half_life_requests: float) -> None: ...
    def share(self, key: int) -> float: ...
    def engine(self, key: int) -> int: ...
    def is_hot(self, key: int, enter_share: float, leave_share: float) -> bool: ...
    def reset(self) -> None: ...

class KeyLog:
    """One reader and writer of the host's key log (compiled; spec ``keylog_py``)."""

    capacity: int
    writer_id: int
    channel: int
    lost: int
    observed: int
    def __init__(
        self, buffer: Any, writer_id: int, channel: int, lock_fd: int | None = None
    ) -> None: ...
    @property
    def position(self) -> int: ...
    def publish(
        self, keys: Sequence[int], n_observe: int, engine_id: int = 0, whole: int | None = None
    ) -> None: ...
    def publish_imported(
        self, keys: Sequence[int], n_observe: int, channel: int, engine_id: int = 0
    ) -> None: ...
    def drain(self, hot: HotKeys, seen: HotKeys, wholes: HotKeys | None = None) -> int: ...
    def export(
        self, since: int, max_entries: int
    ) -> tuple[int, list[tuple[int, int, list[int], int]]]: ...
    def release(self) -> None: ...

class PrefixPicker:
    """The per-request work of ``prefix-hrw`` (compiled)."""

    block_bytes: int
    prefix_bytes: int
    balance_factor: float
    affinity_slack: float
    stall_weight: float
    hot_share_factor: float
    deep: bool
    bytes_per_token: float
    hot: HotKeys
    seen: HotKeys
    wholes: HotKeys
    log: KeyLog | None
    def __init__(
        self,
        block_bytes: int,
        prefix_bytes: int,
        balance_factor: float,
        hot_share_factor: float,
        hot_half_life_requests: float,
        deep: bool = False,
        bytes_per_token: float = 4.0,
        max_keys: int = ...,
        affinity_slack: float = 1.0,
        stall_weight: float = 0.0,
    ) -> None: ...
    def keys(
        self, prefix: bytes, key_hash: int, key_depth_bytes: int, prompt_tokens: int = 0
    ) -> list[tuple[int, int]]: ...
    def choose(
        self,
        selector: Selector,
        request: Any,
        available: np.ndarray | None,
        loads: Any,
        k: int,
        in_flight: Callable[[], np.ndarray] | None = None,
    ) -> tuple[list[int], str, int, int]: ...
    def attach_log(self, log: KeyLog | None) -> None: ...
    def on_routed(self, request: Any, engine_id: int = 0) -> None: ...
    def reset(self) -> None: ...
