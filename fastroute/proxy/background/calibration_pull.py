"""Start a fresh worker from the fleet's calibration (``GET {controller_url}/v1/calibration``).

The controller publishes, per engine type, the step-time calibration of the proxy worker
that has seen the most samples (:mod:`controller.calibration`; workers attach their
:class:`~fastroute.predict.CalibrationSnapshot` to their reports). A worker whose
``marginal-cost`` classes calibrate (``calibrate = true``) asks for it once at start and
loads it if it has not folded in any observation of its own yet, so a restarted or added
worker routes with the fleet's fitted constants from its first request.

Bounded: at most ``attempts`` requests, ``interval_s`` apart, each with ``timeout_s``; a
404 (nothing published yet: the fleet is fresh too) or any error just means the worker
calibrates from its own requests, as it would without a controller. Never on the request
path.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp
import msgspec

from fastroute.predict import CalibrationSnapshot, FleetCalibration
from fastroute.signals.body import read_bounded

__all__ = ["CalibrationPull", "MAX_CALIBRATION_BYTES"]

logger = logging.getLogger(__name__)

#: Largest published calibration accepted (a few KiB per engine type in practice).
MAX_CALIBRATION_BYTES = 4 * 1024 * 1024
_decoder = msgspec.msgpack.Decoder(CalibrationSnapshot)


class CalibrationPull:
    """Load the controller's published calibration into a fresh worker, once.

    Parameters
    ----------
    controller_url : str
        ``http(s)://host:port`` of the controller.
    calibration : callable
        Returns the calibration in force (the ``marginal-cost`` policy's), or None when no
        class calibrates.
    attempts : int
        Requests at most, >= 1; 5.
    interval_s : float
        Wait between attempts; 2 s.
    timeout_s : float
        Per request; 2 s.

    Attributes
    ----------
    outcome : str
        ``pending``, ``loaded``, ``not_needed`` (nothing calibrates, or the worker already
        has observations of its own), ``none_published`` or ``failed``.
    """

    def __init__(
        self,
        controller_url: str,
        calibration: Callable[[], FleetCalibration | None],
        *,
        attempts: int = 5,
        interval_s: float = 2.0,
        timeout_s: float = 2.0,
    ) -> None:
        if attempts < 1 or not interval_s >= 0 or not timeout_s > 0:
            raise ValueError("attempts >= 1, interval_s >= 0 and timeout_s > 0")
        self.url = controller_url.rstrip("/") + "/v1/calibration?format=msgpack"
        self.calibration = calibration
        self.attempts = attempts
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.outcome = "pending"

    def _wanted(self) -> FleetCalibration | None:
        cal = self.calibration()
        if cal is None or not cal.calibrate or cal.samples_total() > 0:
            return None
        return cal

    async def run(self) -> None:
        """Try up to ``attempts`` times; sets :attr:`outcome`."""
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            for attempt in range(self.attempts):
                if attempt:
                    await asyncio.sleep(self.interval_s)
                if self._wanted() is None:
                    self.outcome = "not_needed"
                    return
                try:
                    async with http.get(self.url) as resp:
                        if resp.status == 404:
                            self.outcome = "none_published"
                            continue
                        if resp.status != 200:
                            raise aiohttp.ClientError(f"HTTP {resp.status}")
                        body = await read_bounded(resp.content, MAX_CALIBRATION_BYTES)
                    if len(body) > MAX_CALIBRATION_BYTES:
                        raise ValueError(f"larger than {MAX_CALIBRATION_BYTES} bytes")
                    snapshot = _decoder.decode(body)
                except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                    # msgspec.DecodeError is a ValueError
                    self.outcome = "failed"
                    logger.info("calibration from %s not loaded: %s", self.url, exc)
                    continue
                cal = self._wanted()
                if cal is None:
                    self.outcome = "not_needed"
                    return
                cal.load(snapshot)
                self.outcome = "loaded"
                logger.info(
                    "started from the fleet's calibration (%s)", ", ".join(sorted(snapshot.types))
                )
                return
