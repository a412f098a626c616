"""The demo's embedded fleet and workload (no file needed: it works from an installed wheel).

Two regions 80 ms apart: ``us-east`` with four H100-class engines and ``eu-west``
with four A40-class engines; in each region two engines serve ``llama-3-8b`` and two
serve ``mistral-7b``. Traffic comes from both regions (one proxy per source cluster):
multi-turn chat of two tenants with shared system prompts, Poisson session arrivals.
At the default rate (6 sessions/s, about 13 requests/s) the near H100s take most of
the traffic and the controller spills some to the far A40s; the nominal capacities
(``capacity_rps``) are the operator's conservative figures, not the emulator's limits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastroute.fleetbench.fleet import EngineGroup, FleetSpec, RegionSpec

if TYPE_CHECKING:
    from fastroute.workload import ChatWorkload

__all__ = ["DEMO_FLEET", "SOURCES", "MODELS", "SLO_S", "demo_workload"]

MODELS = ("llama-3-8b", "mistral-7b")
SOURCES = ("us-east", "eu-west")
#: Model → (TTFT SLO, TBOT SLO), seconds: the classes of the demo's config and its goodput.
SLO_S = {MODELS[0]: (1.0, 0.1), MODELS[1]: (1.0, 0.1)}

DEMO_FLEET = FleetSpec(
    regions=(RegionSpec(name="us-east", zone="us"), RegionSpec(name="eu-west", zone="eu")),
    rtt_ms={"us-east": {"eu-west": 80.0}},
    groups=(
        EngineGroup(name="h100-llama", count=2, profile="h100", model=MODELS[0],
                    region="us-east", capacity_rps=6.0),
        EngineGroup(name="h100-mistral", count=2, profile="h100", model=MODELS[1],
                    region="us-east", capacity_rps=6.0),
        EngineGroup(name="a40-llama", count=2, profile="a40", model=MODELS[0],
                    region="eu-west", capacity_rps=2.0),
        EngineGroup(name="a40-mistral", count=2, profile="a40", model=MODELS[1],
                    region="eu-west", capacity_rps=2.0),
    ),
)  # fmt: skip


def demo_workload(rate_sessions_per_s: float = 6.0) -> ChatWorkload:
    """The demo's chat mix at ``rate_sessions_per_s`` (over both source clusters)."""
    from fastroute.workload import ChatWorkload, LogNormal, TenantMix, Weighted

    return ChatWorkload(
        rate_sessions_per_s=rate_sessions_per_s,
        arrival="poisson",
        mean_turns=3.0,
        think_time_s=1.5,
        prompt_tokens=LogNormal(median=120.0, sigma=0.6, min=8, max=1024),
        output_tokens=LogNormal(median=48.0, sigma=0.6, min=4, max=256),
        max_context_tokens=4096,
        tenants=(
            TenantMix(name="acme", weight=2.0, system_prompt_tokens=400),
            TenantMix(name="globex", weight=1.0, system_prompt_tokens=200),
        ),
        models=(Weighted(name=MODELS[0], weight=2.0), Weighted(name=MODELS[1], weight=1.0)),
        sources=(Weighted(name=SOURCES[0], weight=1.0), Weighted(name=SOURCES[1], weight=1.0)),
    )
