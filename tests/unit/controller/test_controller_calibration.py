"""CalibrationBoard: the latest snapshot per worker, the most-sampled state per type."""

from __future__ import annotations

import pytest

from controller.calibration import CalibrationBoard
from fastroute.predict import FleetCalibration


def _learned(prefills: int, decodes: int, type_name: str = "a40") -> FleetCalibration:
    cal = FleetCalibration()
    for i in range(prefills):
        cal.observe_prefill(type_name, 1, 200 + i, 0, 0.03 + 1e-5 * i)
    for i in range(decodes):
        cal.observe_decode(type_name, 1, 8, 8 * (500 + i), 0.012 + 1e-6 * i)
    return cal


def test_nothing_is_published_before_a_calibrated_type_is_reported() -> None:
    board = CalibrationBoard()
    assert board.published() is None
    board.observe("w-1", FleetCalibration().snapshot())  # nominal: no samples
    assert board.published() is None


def test_per_type_the_most_sampled_worker_wins_and_a_newer_report_replaces() -> None:
    board = CalibrationBoard()
    board.observe("w-1", _learned(30, 30).snapshot())
    board.observe("w-2", _learned(5, 5).snapshot())
    h100 = _learned(12, 0, "h100")
    board.observe("w-3", h100.snapshot())
    snap = board.published()
    assert snap is not None and set(snap.types) == {"a40", "h100"}
    assert snap.types["a40"].n_samples == 60 and snap.types["h100"].n_samples == 12
    board.observe("w-1", _learned(1, 1).snapshot())  # w-1 restarted: its state is gone
    again = board.published()
    assert again is not None and again.types["a40"].n_samples == 10


def test_workers_are_bounded_oldest_first() -> None:
    board = CalibrationBoard(max_workers=2)
    board.observe("w-1", _learned(50, 0).snapshot())
    board.observe("w-2", _learned(3, 0).snapshot())
    board.observe("w-3", _learned(4, 0).snapshot())
    snap = board.published()
    assert len(board) == 2 and snap is not None and snap.types["a40"].n_samples == 4
    with pytest.raises(ValueError, match="max_workers"):
        CalibrationBoard(max_workers=0)
