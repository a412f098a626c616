"""The calibration of a whole fleet: one step-time model per engine type, a KV-transfer
model, and their export as plain data.

:class:`FleetCalibration` is what a data plane (or the simulator) keeps and feeds:

* ``observe_prefill`` / ``observe_decode`` / ``observe_step`` fold measured timings
  into the engine type's :class:`~fastroute.predict.step_time.StepTimeModel` (TTFT
  and TBOT per request in the proxy; exact steps in the simulator);
* ``observe_transfer`` calibrates the P→D KV transfer time;
* :meth:`snapshot` exports everything as a :class:`CalibrationSnapshot` (a msgspec
  Struct: ``msgspec.json.encode`` it for publication, :meth:`to_dict` for /metrics
  and decision records), and :meth:`load` starts a new worker from a snapshot the
  controller published for its group, so it is calibrated from its first request.

KV transfer (docs/algorithms.md §6.3)
    ``T_x(tokens) = latency + tokens · bytes_per_token / bandwidth``, fitted online as
    a two-coefficient :class:`~fastroute.predict.rls.RobustRLS` (``[1, tokens]``)
    from the nominal NIC figures. One model per fleet: topology classes (same node /
    rack / pod) are not modelled yet.

Engine types are names (``"a40"``, ``"h100"``); an unknown name starts from the
built-in emulator profile of that name if there is one, else from the default type's
constants.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from fastroute.hardware import PROFILES, HardwareProfile
from fastroute.predict.rls import RobustRLS
from fastroute.predict.step_time import (
    NominalStepTimes,
    StepModelState,
    StepTimeModel,
    decode_features,
    prefill_features,
    step_features,
)

__all__ = [
    "CalibrationSnapshot",
    "FleetCalibration",
    "KVTransferModel",
    "TransferState",
    "DEFAULT_TYPE",
    "datasheet_profile",
]

#: Engine type assumed when nothing says otherwise.
DEFAULT_TYPE = "a40"


def datasheet_profile(type_name: str, default_type: str = DEFAULT_TYPE) -> HardwareProfile | None:
    """The built-in profile an engine type starts from: its own if ``type_name`` names one,
    else ``default_type``'s (None if neither is a built-in). One rule for the proxy and the
    simulator: a hardware label an operator chose starts from the default's constants."""
    return PROFILES.get(type_name.lower()) or PROFILES.get(default_type)


class TransferState(msgspec.Struct):
    """Exported KV-transfer calibration: ``latency_s + tokens · s_per_token``."""

    latency_s: float
    s_per_token: float
    n_samples: int


class CalibrationSnapshot(msgspec.Struct):
    """Everything a worker needs to start calibrated (plain data).

    Attributes
    ----------
    types : dict of str to StepModelState
        Per engine type.
    transfer : TransferState
        KV transfer model.
    """

    types: dict[str, StepModelState]
    transfer: TransferState


class KVTransferModel:
    """Calibrated P→D KV transfer time.

    Parameters
    ----------
    latency_s : float
        Nominal fixed latency (handshake + first byte).
    bytes_per_token : float
        KV bytes per token of the model.
    bandwidth_Bps : float
        Nominal bandwidth, bytes per second.
    calibrate : bool
        Fold observations in (default) or keep the nominal figures.
    """

    def __init__(
        self,
        latency_s: float = 1.0e-3,
        bytes_per_token: float = 131072.0,
        bandwidth_Bps: float = 12.5e9,
        *,
        calibrate: bool = True,
    ) -> None:
        if latency_s < 0 or bytes_per_token <= 0 or bandwidth_Bps <= 0:
            raise ValueError("latency_s >= 0, bytes_per_token > 0 and bandwidth_Bps > 0")
        self.calibrate = calibrate
        self.rls = RobustRLS(
            [max(latency_s, 1e-6), bytes_per_token / bandwidth_Bps], [1.0, 1e-3], floor=1e-5
        )

    def predict_s(self, tokens: float) -> float:
        """Predicted time to move the KV of ``tokens`` tokens, seconds."""
        lat, per_token = self.rls.coef
        return lat + per_token * max(0.0, tokens)

    def observe(self, tokens: int, time_s: float) -> None:
        """Fold in one measured transfer."""
        if time_s <= 0 or tokens < 0:
            raise ValueError(f"need tokens >= 0 and time_s > 0, got {tokens}, {time_s}")
        if self.calibrate:
            self.rls.update([1.0, float(tokens)], time_s)

    def state(self) -> TransferState:
        """The calibration as plain data."""
        lat, per_token = self.rls.coef
        return TransferState(lat, per_token, self.rls.n_samples)

    def load(self, state: TransferState) -> None:
        """Start from a published state."""
        self.rls.load([state.latency_s, state.s_per_token], state.n_samples, 0.05)

    def reset(self) -> None:
        """Back to the nominal figures."""
        self.rls.reset()


class FleetCalibration:
    """Step-time models by engine type plus the KV-transfer model.

    Parameters
    ----------
    nominal : mapping of str to NominalStepTimes, optional
        Starting constants per type; types not listed come from the emulator's
        built-in profiles (by name) or ``default_type``'s.
    default_type : str
        Type of engines nothing is known about.
    calibrate : bool
        False: every model keeps its nominal constants (observations are ignored).
    max_num_batched_tokens : int, optional
        Override the step token budget of every type.
    transfer : KVTransferModel, optional
        KV transfer model; nominal one-NIC figures if omitted.
    forgetting : float
        RLS forgetting factor of every type.
    """

    def __init__(
        self,
        nominal: Mapping[str, NominalStepTimes] | None = None,
        *,
        default_type: str = DEFAULT_TYPE,
        calibrate: bool = True,
        max_num_batched_tokens: int | None = None,
        transfer: KVTransferModel | None = None,
        forgetting: float = 0.995,
    ) -> None:
        self.calibrate = bool(calibrate)
        self.default_type = default_type
        self.forgetting = forgetting
        self.max_num_batched_tokens = max_num_batched_tokens
        self._nominal = dict(nominal or {})
        if default_type not in self._nominal and default_type not in PROFILES:
            raise ValueError(
                f"unknown default engine type {default_type!r}: give its nominal constants "
                f"or use one of {sorted(PROFILES)}"
            )
        self.transfer = transfer or KVTransferModel(calibrate=calibrate)
        self._models: dict[str, StepTimeModel] = {}

    def nominal(self, type_name: str) -> NominalStepTimes:
        """The starting constants of ``type_name``."""
        nom = self._nominal.get(type_name)
        if nom is None:
            profile = datasheet_profile(type_name, self.default_type)
            if profile is None:
                return self._nominal[self.default_type]
            nom = NominalStepTimes.from_profile(profile)
        if self.max_num_batched_tokens:
            nom = msgspec.structs.replace(nom, max_num_batched_tokens=self.max_num_batched_tokens)
        return nom

    def model(self, type_name: str | None = None) -> StepTimeModel:
        """The step-time model of ``type_name`` (created on first use)."""
        name = type_name or self.default_type
        m = self._models.get(name)
        if m is None:
            m = self._models[name] = StepTimeModel(
                self.nominal(name), calibrate=self.calibrate, forgetting=self.forgetting
            )
        return m

    # -- observations ----------------------------------------------------------------------

    def observe_prefill(
        self,
        type_name: str | None,
        engine_id: int | None,
        n: int,
        c: int,
        time_s: float,
        *,
        batch: int = 0,
        context: int = 0,
        queued_tokens: int = 0,
    ) -> None:
        """A measured prefill phase (e.g. TTFT minus network time).

        Parameters
        ----------
        type_name, engine_id
            The engine measured.
        n, c : int
            New and cached prompt tokens.
        time_s : float
            Measured seconds from arrival at the engine to the first token.
        batch, context : int
            Decoding sequences and their context during the prefill (0 on a prefill
            engine).
        queued_tokens : int
            Prompt tokens queued ahead of it when it arrived (their prefill is part of
            the measured time).
        """
        m = self.model(type_name)
        f = prefill_features(n, c, batch=batch, context=context, budget=m.budget)
        if queued_tokens > 0:
            q = prefill_features(queued_tokens, 0, batch=batch, context=context, budget=m.budget)
            f = [a + b for a, b in zip(f, q, strict=True)]
        m.observe(f, time_s, kind="prefill", engine_id=engine_id)

    def observe_decode(
        self,
        type_name: str | None,
        engine_id: int | None,
        batch: int,
        context: int,
        time_s: float,
        *,
        prefill_tokens_per_step: float = 0.0,
    ) -> None:
        """A measured decode step (e.g. a request's mean time between output tokens).

        ``prefill_tokens_per_step``: other requests' uncached prompt tokens dispatched to
        the engine during the request's decode, per decode step (a co-located engine
        runs their prefill chunks beside the decodes;
        :class:`~fastroute.predict.interleave.PrefillInterleave`); fitted by the ``m1``
        coefficient so b0..b2 do not absorb the interference.
        """
        if not prefill_tokens_per_step >= 0.0:
            raise ValueError(f"prefill_tokens_per_step must be >= 0, got {prefill_tokens_per_step}")
        self.model(type_name).observe(
            decode_features(batch, context, float(prefill_tokens_per_step)),
            time_s,
            kind="decode",
            engine_id=engine_id,
        )

    def observe_step(
        self,
        type_name: str | None,
        engine_id: int | None,
        batch: int,
        context: int,
        time_s: float,
        *,
        new: int = 0,
        new_sq: float = 0.0,
        new_cached: float = 0.0,
    ) -> None:
        """One exactly known scheduler step (simulator, emulator step log)."""
        kind = "prefill" if new else "decode"
        self.model(type_name).observe(
            step_features(batch, context, new, new_sq, new_cached),
            time_s,
            kind=kind,
            engine_id=engine_id,
        )

    def observe_transfer(self, tokens: int, time_s: float) -> None:
        """A measured KV transfer of ``tokens`` tokens."""
        self.transfer.observe(tokens, time_s)

    # -- export ----------------------------------------------------------------------------

    def samples_total(self) -> int:
        """Observations folded in over every type and the transfer model (0: nominal)."""
        steps = sum(m.rls.n_samples for m in self._models.values())
        return steps + self.transfer.rls.n_samples

    def snapshot(self) -> CalibrationSnapshot:
        """Every type's state and the transfer model, as plain data."""
        return CalibrationSnapshot(
            types={name: m.state() for name, m in self._models.items()},
            transfer=self.transfer.state(),
        )

    def to_dict(self) -> dict[str, Any]:
        """:meth:`snapshot` as builtins (JSON-ready; engine ids become strings)."""
        return msgspec.to_builtins(self.snapshot(), str_keys=True)

    def load(self, snapshot: CalibrationSnapshot, *, residuals: bool = False) -> None:
        """Start every type in ``snapshot`` (and the transfer model) from its state."""
        for name, state in snapshot.types.items():
            self.model(name).load(state, residuals=residuals)
        self.transfer.load(snapshot.transfer)

    def reset(self) -> None:
        """Back to nominal constants everywhere."""
        self._models.clear()
        self.transfer.reset()
