"""Options of one :class:`controller.service.ControllerService` beyond the config file.

The config (``[controller]`` and the fleet) says what to control; these say how this process
runs it: which planner, the baseline's gains, the learning and republish tunables. The defaults
are what ``fastroute controller`` runs; tests and experiments change single fields.
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["MODES", "ControllerOptions"]

#: Control policies: the LP (default) and the legacy proportional controller (baseline).
MODES: tuple[str, ...] = ("lp", "p-controller")


class ControllerOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How one controller process runs (every field has the default ``fastroute controller`` uses).

    Attributes
    ----------
    table_name : str, optional
        Shared-memory table to write; default (None) ``config.proxy.table_name``.
    mode : {"lp", "p-controller"}
        ``"lp"`` (the optimiser, default) or ``"p-controller"`` (the legacy baseline,
        :class:`controller.baseline.BaselinePolicy`, for experiments); both publish the same way.
    default_fraction : float
        Demand of a class before any report, as a fraction of its share of the capacity
        (default 0.5: the defaults of all classes together ask for half the fleet).
    shed_retry_factor : float
        Retry ratio multiplier while any class is shed (default 0.2).
    profile_half_life_windows : float
        Half-life in periods of the online profile fit (:class:`controller.profiles.ProfileFitter`;
        default 60).
    profile_deadband : float
        A refitted group profile replaces the one in use only when some segment slope moved by more
        than this fraction (default 0.05: small fit noise must not move traffic).
    p_gain : float
        Gain ``K`` of the baseline (``p-controller`` only; default 0.5).
    p_ewma_alpha : float
        EWMA factor of the baseline's latency estimate (``p-controller`` only; default 0.5).
    republish_after_s : float, optional
        An unchanged plan is still published (new generation) once the table in force is this many
        seconds old, so the data planes' table age tells a live controller from a dead one;
        default (None) ``10 · controller.period_s``.
    reprofile_after_windows : int, optional
        An engine derated for latency this many consecutive windows with a *stable* residual
        (:meth:`controller.learning.FleetLearning.reprofile`) gets its own profile and full health
        back; default (None) ``4 · controller.derating.exit_windows``.
    reprofile_max_dispersion_log : float
        "Stable": robust dispersion (1.4826 · MAD) of the windows' log latency ratios at most this
        (default 0.1).
    health_min_latency_samples : int
        Fewest TTFT (TBOT) samples of an engine in a window for its latency to be scored
        (default 20).
    """

    table_name: str | None = None
    mode: Literal["lp", "p-controller"] = "lp"
    default_fraction: float = 0.5
    shed_retry_factor: float = 0.2
    profile_half_life_windows: float = 60.0
    profile_deadband: float = 0.05
    p_gain: float = 0.5
    p_ewma_alpha: float = 0.5
    republish_after_s: float | None = None
    reprofile_after_windows: int | None = None
    reprofile_max_dispersion_log: float = 0.1
    health_min_latency_samples: int = 20

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
