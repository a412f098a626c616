"""Calibrated prediction for routing (docs/design.md §1B; docs/algorithms.md §6.3).

* :mod:`~fastroute.predict.rls` — recursive least squares with forgetting, relative
  weighting and Huber-robust weights;
* :mod:`~fastroute.predict.conformal` — sliding-window split-conformal p90 factors;
* :mod:`~fastroute.predict.step_time` — the step-time model of one engine type
  (prefill ``a0 + a1·n + a2·n² + a3·n·c``, decode step ``b0 + b1·B + b2·S``) with
  per-engine residuals;
* :mod:`~fastroute.predict.fit` — the offline (batch, relative NNLS) fit of the step-time
  model to measured points;
* :mod:`~fastroute.predict.profiles` — step-time constants measured on real engines;
* :mod:`~fastroute.predict.calibration` — a fleet's models by type, the KV-transfer
  model, export/import as plain data;
* :mod:`~fastroute.predict.output_length` — output-length histograms with back-off;
* :mod:`~fastroute.predict.reject_bound` — early rejection bounded by realised SLO
  attainment, with probes (:class:`RejectBound`).

Nothing here reads a clock or does I/O; time is passed in (``now_s``).
"""

from fastroute.predict.calibration import (
    DEFAULT_TYPE,
    CalibrationSnapshot,
    FleetCalibration,
    KVTransferModel,
    TransferState,
)
from fastroute.predict.conformal import ConformalBound
from fastroute.predict.output_length import OutputLengthPredictor
from fastroute.predict.reject_bound import RejectBound
from fastroute.predict.rls import RobustRLS
from fastroute.predict.step_time import (
    COEF_NAMES,
    NominalStepTimes,
    StepModelState,
    StepTimeModel,
    chunk_sums,
    decode_features,
    prefill_features,
    queue_features,
    step_features,
)

__all__ = [
    "COEF_NAMES",
    "DEFAULT_TYPE",
    "CalibrationSnapshot",
    "ConformalBound",
    "FleetCalibration",
    "KVTransferModel",
    "NominalStepTimes",
    "OutputLengthPredictor",
    "RejectBound",
    "RobustRLS",
    "StepModelState",
    "StepTimeModel",
    "TransferState",
    "chunk_sums",
    "decode_features",
    "prefill_features",
    "queue_features",
    "step_features",
]
