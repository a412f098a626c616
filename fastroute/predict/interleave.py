"""Prefill tokens interleaved with a request's decode steps, as a data plane can count them.

On a co-located engine (chunked prefill) every decode step may also run chunks of other
requests' prompts, so a request's mean time between output tokens is a mean over *mixed*
steps (docs/algorithms.md §6.3: ``T = T_dec(B, S) + a1'·chunk``). A router sees
no chunks, but it sees when the prompts it sent finish their prefill: at their first
token. :class:`PrefillInterleave` keeps, per engine:

* a cumulative count of the **uncached prompt tokens** prefilled there
  (:meth:`prefilled`, at each request's first token): prompt tokens times the engine's
  recent uncached share, learned from the cached-token counts engines report at the end of
  a request (:meth:`observe_cached`), since whether a prompt hits the prefix cache is only
  known afterwards;
* the expected prefill tokens per decode step (:attr:`expected`: over recently finished
  requests, decayed Σ tokens / decayed Σ decode steps, so a short request that happened to
  run beside one long prompt does not swing it), which the ``marginal-cost`` policy reads
  as the engine's interference on a new request's decode.

A request's feature is ``(count at its end − count at its first token) / decode steps``
(:meth:`mark` at its first token, after counting its own prompt; :meth:`per_step` at its
end): the prompt tokens whose prefill finished during its decode, give or take the last
chunk. Counting prompts when they are dispatched instead was tried first: it misses the
prompts queued on the engine before the request's first token and prefilled during its
decode, which on an engine with a backlog are most of them (the fit then put that
interference into b2, at 20x its true value). The proxy
(:mod:`fastroute.proxy.path.engine_load`) and the simulator (:mod:`fastroute.sim.core`) make
the same calls.
"""

from __future__ import annotations

__all__ = ["PrefillInterleave"]


class PrefillInterleave:
    """Per-engine prefilled uncached prompt tokens and their density per decode step.

    Parameters
    ----------
    n_engines : int
        Engines, by index.
    alpha : float
        Weight of one finished request in :attr:`expected`'s decayed sums and in the
        uncached share's EWMA, in (0, 1].

    Attributes
    ----------
    prefilled_tokens : list of float
        Cumulative uncached prompt tokens prefilled, per engine (estimated).
    uncached_share : list of float
        Recent share of prompt tokens not served from the prefix cache, per engine
        (1 until a request reports its cached tokens).
    expected : list of float
        Expected prefill tokens per decode step of a request decoding there, per engine.
    """

    __slots__ = ("alpha", "prefilled_tokens", "uncached_share", "expected", "_tokens", "_steps")

    def __init__(self, n_engines: int, alpha: float = 0.1) -> None:
        if n_engines < 0:
            raise ValueError(f"n_engines must be >= 0, got {n_engines}")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = float(alpha)
        self.prefilled_tokens = [0.0] * n_engines
        self.uncached_share = [1.0] * n_engines
        self.expected = [0.0] * n_engines
        self._tokens = [0.0] * n_engines  # decayed Σ tokens beside finished requests
        self._steps = [0.0] * n_engines  # decayed Σ their decode steps

    def prefilled(self, index: int, prompt_tokens: int) -> None:
        """A prompt of ``prompt_tokens`` tokens finished its prefill on engine ``index``
        (its first token arrived)."""
        if prompt_tokens > 0:
            self.prefilled_tokens[index] += prompt_tokens * self.uncached_share[index]

    def mark(self, index: int) -> float:
        """The engine's count now (take it at a request's first token)."""
        return self.prefilled_tokens[index]

    def per_step(self, index: int, mark: float, decode_steps: int) -> float:
        """Prefill tokens per decode step since ``mark``, over ``decode_steps`` steps.

        Also folds the count into :attr:`expected`. Returns 0 for ``decode_steps < 1``.
        """
        if decode_steps < 1:
            return 0.0
        tokens = max(0.0, self.prefilled_tokens[index] - mark)
        keep = 1.0 - self.alpha
        self._tokens[index] = keep * self._tokens[index] + tokens
        self._steps[index] = keep * self._steps[index] + decode_steps
        self.expected[index] = self._tokens[index] / self._steps[index]
        return tokens / decode_steps

    def observe_cached(self, index: int, prompt_tokens: int, cached_tokens: int) -> None:
        """A request on engine ``index`` reported ``cached_tokens`` of its ``prompt_tokens``
        served from the prefix cache."""
        if prompt_tokens <= 0:
            return
        share = 1.0 - min(max(cached_tokens, 0), prompt_tokens) / prompt_tokens
        self.uncached_share[index] += self.alpha * (share - self.uncached_share[index])
