"""The four-engine, two-region test fleet the in-process controller tests share."""

from __future__ import annotations

from collections.abc import Sequence

from fastroute.testing.configs import engines_toml

MODEL = "demo-8b"
ENGINES = [f"engine-{i}" for i in range(4)]
REGIONS = ("east", "west")  # engine-0/1 east, engine-2/3 west
FAKE_URLS = [f"http://127.0.0.1:{9 + i}" for i in range(4)]  # never contacted


def two_region_toml(
    table_name: str,
    *,
    urls: Sequence[str] = FAKE_URLS,
    port: int = 0,
    controller: str = "",
    proxy: str = "",
    tables: str = "",
) -> str:
    """The fleet's config: engines at 10 req/s, east ↔ west 80 ms, a 0.2 s control period.

    ``controller`` and ``proxy`` are added to those tables, ``tables`` (whole tables) at the end.
    """
    regions = [REGIONS[i // 2] for i in range(len(urls))]
    return (
        engines_toml(urls, MODEL, regions=regions)
        + '[[network.regions]]\nname = "east"\n\n[[network.regions]]\nname = "west"\n\n'
        + "[network.rtt_ms]\neast = { west = 80.0 }\n\n"
        + f"[controller]\nport = {port}\nperiod_s = 0.2\nsolve_time_limit_s = 0.15\n{controller}\n"
        + f'[proxy]\nport = 0\ncluster = "east"\ntable_name = "{table_name}"\n{proxy}\n'
        + tables
    )


#: Derating without its change-rate limit (periods run back to back in the tests).
FAST_DERATING = "[controller.derating]\nmin_change_interval_s = 0.001\n"
