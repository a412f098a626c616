"""Hedged first tokens in the simulator, with the proxy's rule
(:mod:`fastroute.proxy.path.hedge`): a request whose first token has not reached its
data plane after the hedge delay is also sent to the runner-up of its ranking; the
first attempt to emit a token wins and the other is cancelled on its engine at that
moment (the prefill it did until then is real work, counted as the request's
``hedge_prefill_tokens``). One retry from the data plane's budget per hedge; none while
the class is shed; the delay is the ``dataplane.hedge_quantile`` of the data plane's
recent client first-token times per class (conformal bound over ``hedge_window``),
bounded below by ``hedge_floor_s``, the SLO's ``ttft_s`` before ``hedge_min_samples``.
"""

from __future__ import annotations

from typing import Any

from fastroute.predict.conformal import ConformalBound

__all__ = ["HedgeDelays"]


class HedgeDelays:
    """Per (data plane, class row) hedge delays from client first-token times.

    Parameters
    ----------
    config : DataPlaneConfig
        ``hedge_quantile``, ``hedge_floor_s``, ``hedge_window``, ``hedge_min_samples``.
    default_s : float
        The delay before enough samples (the scenario's TTFT SLO).
    """

    def __init__(self, config: Any, default_s: float) -> None:
        self.config = config
        self.default_s = default_s
        self._bounds: dict[tuple[int, int], ConformalBound] = {}

    def _bound(self, dp_id: int, row: int) -> ConformalBound:
        key = (dp_id, row)
        bound = self._bounds.get(key)
        if bound is None:
            cfg = self.config
            bound = self._bounds[key] = ConformalBound(
                cfg.hedge_quantile,
                window=cfg.hedge_window,
                min_samples=cfg.hedge_min_samples,
                default_factor=self.default_s,
            )
        return bound

    def observe(self, dp_id: int, row: int, ttft_s: float) -> None:
        """A client first-token time of class ``row`` at data plane ``dp_id``."""
        self._bound(dp_id, row).add(ttft_s, 1.0)

    def delay_s(self, dp_id: int, row: int) -> float:
        """How long a request waits for its first token before it is hedged."""
        return max(self.config.hedge_floor_s, self._bound(dp_id, row).factor())
