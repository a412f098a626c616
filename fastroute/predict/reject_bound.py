"""Early rejection checked against realised outcomes: probes and an attainment bound.

A policy that rejects a request because a model predicts it would miss its SLO never
learns whether the prediction was right: the rejected request produces no timing sample.
If the model drifts pessimistic (a calibration that over-fits a few slow steps), every
request is predicted infeasible, nothing is admitted, nothing corrects the model, and
the policy stays locked out of a fleet that would serve fine. :class:`RejectBound` turns
that absorbing state into a transient, with two mechanisms:

**Probes.** A fraction ``probe_rate`` of the requests predicted infeasible is admitted
anyway (*probes*: every ``round(1 / probe_rate)``-th one, deterministic, so recovery
time is bounded and runs are reproducible): a probe's realised TTFT/TPOT is measured
like any other, so the calibration keeps receiving samples from exactly the load states
the model rejects in, and the attainment window below keeps receiving fresh outcomes.

**Attainment bound.** The fraction of the last ``window`` decisions that were rejections
may not exceed the measured shortfall: the fraction of the last ``window`` admitted
requests whose realised latency missed their SLO, with a Laplace prior,
``(misses + 1) / (outcomes + 2)`` (one pseudo-miss and one pseudo-hit: with 100
outcomes that all met, under 1 %). Before the first outcome there is no evidence
against the model and only the probes limit rejection (the bound is 1). A predicted-infeasible
request whose rejection would break the bound is admitted instead. When admitted
requests meet their SLOs the bound falls towards zero and the policy admits nearly
everything, whatever the model predicts; when they miss, it may reject about as many as
miss. In a genuine overload this is an equilibrium, not the ideal admission (the
rejected fraction settles near the admitted requests' miss fraction), the price of
never trusting a prediction that no outcome supports.

Recovery from a fully pessimistic model takes at most ``1 / probe_rate`` predicted-
infeasible arrivals (the first probe), plus that probe's latency: once its outcome
lowers the bound below the reject fraction, ordinary requests are admitted, and each of
their outcomes lowers it further.

Pure state, no clock: the caller reports decisions as they are made and outcomes as
requests finish (the proxy's and the simulator's data planes both do).
"""

from __future__ import annotations

from collections import deque
from enum import Enum

__all__ = [
    "DEFAULT_PROBE_RATE",
    "DEFAULT_REJECT_WINDOW",
    "RejectBound",
    "Verdict",
]

#: Fraction of predicted-infeasible requests admitted anyway (every 20th). 0.05: a fully
#: pessimistic model is probed within 20 predicted-infeasible arrivals (seconds at
#: production rates), while a genuine overload admits 5 % of the requests the model
#: would reject, which then most likely miss.
DEFAULT_PROBE_RATE = 0.05
#: Decisions and admitted outcomes the bound is measured over (requests): 100 resolves
#: the fractions to 1 % and forgets a stale overload within 100 admissions.
DEFAULT_REJECT_WINDOW = 100


class Verdict(Enum):
    """What to do with a request predicted to miss its SLO."""

    #: Reject it (early 429).
    REJECT = "reject"
    #: Admit it as a probe: route it where it is predicted to do best, and measure it.
    PROBE = "probe"
    #: Admit it because the bound forbids another rejection (route it where a miss
    #: harms the fewest others).
    ADMIT = "admit"


class RejectBound:
    """Whether a predicted-infeasible request may be rejected (see the module docstring).

    Parameters
    ----------
    probe_rate : float
        Fraction in ``(0, 1]`` of the predicted-infeasible requests admitted as probes
        (every ``round(1 / probe_rate)``-th); :data:`DEFAULT_PROBE_RATE`.
    window : int
        Decisions, and admitted outcomes, the fractions are measured over (>= 1);
        :data:`DEFAULT_REJECT_WINDOW`.

    Raises
    ------
    ValueError
        ``probe_rate`` outside ``(0, 1]`` or ``window < 1``.
    """

    __slots__ = (
        "probe_rate",
        "window",
        "_probe_every",
        "_since_probe",
        "_decisions",
        "_rejects",
        "_outcomes",
        "_misses",
    )

    def __init__(
        self, probe_rate: float = DEFAULT_PROBE_RATE, window: int = DEFAULT_REJECT_WINDOW
    ) -> None:
        if not 0.0 < probe_rate <= 1.0:
            # 0 would make a model that rejects everything before any outcome permanent.
            raise ValueError(f"probe_rate must be in (0, 1], got {probe_rate}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.probe_rate = float(probe_rate)
        self.window = int(window)
        self._probe_every = round(1.0 / probe_rate)
        self._since_probe = 0  # predicted-infeasible requests since the last probe
        self._decisions: deque[bool] = deque()  # True = rejected
        self._rejects = 0
        self._outcomes: deque[bool] = deque()  # True = missed its SLO
        self._misses = 0

    # -- measurements ------------------------------------------------------------------

    @property
    def reject_fraction(self) -> float:
        """Fraction of the recent decisions that were rejections (0 with none)."""
        return self._rejects / len(self._decisions) if self._decisions else 0.0

    @property
    def miss_fraction(self) -> float:
        """Measured shortfall: ``(misses + 1) / (outcomes + 2)`` over the recent admitted
        requests' realised outcomes (Laplace prior); 1 before the first outcome."""
        if not self._outcomes:
            return 1.0
        return (self._misses + 1) / (len(self._outcomes) + 2)

    @property
    def outcomes(self) -> int:
        """Admitted outcomes in the window."""
        return len(self._outcomes)

    # -- decisions ---------------------------------------------------------------------

    def admitted(self) -> None:
        """A request was admitted (predicted feasible, or routed anyway)."""
        self._decide(False)

    def verdict(self) -> Verdict:
        """A request is predicted infeasible: reject it, or admit it as a probe (every
        ``round(1 / probe_rate)``-th) or because one more rejection would push the reject
        fraction above the measured shortfall. Recorded as a decision either way."""
        self._since_probe += 1
        if self._since_probe >= self._probe_every:
            self._since_probe = 0
            self._decide(False)
            return Verdict.PROBE
        n = len(self._decisions)
        # The reject fraction this rejection would make, over the window it would be in.
        rejects = self._rejects + 1
        if n >= self.window and self._decisions[0]:
            rejects -= 1
        if rejects / min(n + 1, self.window) > self.miss_fraction:
            self._decide(False)
            return Verdict.ADMIT
        self._decide(True)
        return Verdict.REJECT

    def withdraw(self) -> None:
        """Forget the latest decision if it was a rejection that was not carried out (the
        caller routed the request anyway, e.g. without its SLO)."""
        d = self._decisions
        if d and d[-1]:
            d.pop()
            self._rejects -= 1

    def observe(self, missed: bool) -> None:
        """An admitted request finished: ``missed`` = its realised latency missed its SLO."""
        out = self._outcomes
        if len(out) >= self.window and out.popleft():
            self._misses -= 1
        out.append(bool(missed))
        self._misses += bool(missed)

    def _decide(self, rejected: bool) -> None:
        d = self._decisions
        if len(d) >= self.window and d.popleft():
            self._rejects -= 1
        d.append(rejected)
        self._rejects += rejected

    def to_dict(self) -> dict[str, float]:
        """The bound's state as plain data (for /metrics and decision records)."""
        return {
            "probe_rate": self.probe_rate,
            "window": self.window,
            "reject_fraction": self.reject_fraction,
            "miss_fraction": self.miss_fraction,
            "outcomes": self.outcomes,
        }
