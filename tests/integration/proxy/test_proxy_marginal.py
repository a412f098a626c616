"""The ``marginal-cost`` policy in the proxy, against emulated engines on loopback.

A long request goes to the idle engine while the others decode; an SLO no engine can
meet is an early 429 (nothing forwarded); the in-band timings calibrate the policy
(sample counts grow, /metrics shows them, the decision record carries them); P/D
with marginal-cost picks a (prefill, decode) pair end to end.
"""

from __future__ import annotations

import contextlib
import re
import uuid

import aiohttp
import pytest
from proxy_harness import (
    MODEL,
    SHORT_OUTPUTS,
    Harness,
    config_toml,
    decision_record,
    pd_stack,
    serve_proxy,
)

from fastroute.config import decode_config
from fastroute.emulator.server import EmulatedFleet, fleet_specs
from fastroute.predict import FleetCalibration
from fastroute.proxy.path.engine_load import MIN_SAMPLES_TO_REJECT
from fastroute.proxy.path.handler import ProxyContext

pytestmark = pytest.mark.integration

MARGINAL = '[policy]\ndefault = "marginal-cost"\n[policy.params.marginal-cost]\nseed = 7\n'


def _samples(metrics_text: str, kind: str) -> float:
    m = re.search(
        rf'fastroute_proxy_calibration_samples\{{kind="{kind}",type="h100"\}} (\S+)', metrics_text
    )
    assert m is not None, metrics_text[-2000:]
    return float(m.group(1))


def test_long_request_goes_to_the_idle_engine(h: Harness) -> None:
    """Two engines are decoding long answers (routed through the proxy): a long prompt
    goes to the third, idle one, and the record shows the predicted costs."""

    async def main() -> None:
        async with h.proxy_stack(3, extra=MARGINAL) as st, aiohttp.ClientSession() as s:
            busy: list[str] = []
            streams = []
            async with contextlib.AsyncExitStack() as stack:
                for i in range(2):
                    body = h.chat_body(
                        f"busy {i} " + uuid.uuid4().hex,
                        stream=True,
                        max_tokens=4000,
                        ignore_eos=True,
                    )
                    r = await stack.enter_async_context(
                        s.post(st.url + "/v1/chat/completions", json=body)
                    )
                    assert r.status == 200
                    await r.content.readline()  # first event: running on its engine
                    busy.append(r.headers["x-fastroute-engine"])
                    streams.append(r)
                assert len(set(busy)) == 2, busy  # the second avoided the first's engine
                long_text = "lorem ipsum dolor sit amet " * 600  # ~4000 tokens
                body = h.chat_body(long_text, max_tokens=2)
                async with s.post(st.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    engine = r.headers["x-fastroute-engine"]
                    rid = r.headers["x-request-id"]
                assert engine not in busy, (engine, busy)
                record = await decision_record(s, st.url, rid)
                assert record["policy"] == "marginal-cost"
                pred = record["prediction"]
                assert pred["ttft_s"] > 0 and pred["tpot_s"] > 0
                assert len(pred["cost_s"]) == len(record["candidates"]) >= 2
                scores = {c["engine"]: c["score"] for c in record["candidates"]}
                assert all(scores[engine] < scores[b] for b in busy if b in scores)
                for r in streams:
                    r.close()

    h.run(main())


async def _warm_up(h: Harness, s: aiohttp.ClientSession, url: str, n: int) -> None:
    """``n`` streamed requests: a prefill and a decode observation each."""
    for i in range(n):
        body = h.chat_body(f"warm {i}", stream=True, max_tokens=3, ignore_eos=True)
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            await h.read_sse(r)


def test_slo_no_engine_can_meet_is_429_and_nothing_is_forwarded(h: Harness) -> None:
    """A 1 ms TTFT objective: before the calibration has MIN_SAMPLES_TO_REJECT samples
    the request is routed best-effort (the record says why); after, 429 in OpenAI shape
    with the reason, Retry-After, a decision record without attempts, and no engine saw
    the request. A malformed SLO header is a 400 naming it."""

    async def main() -> None:
        async with h.proxy_stack(2, extra=MARGINAL) as st, aiohttp.ClientSession() as s:
            headers = {"x-fastroute-ttft-slo-ms": "1"}
            body = h.chat_body("hello " * 200)
            async with s.post(st.url + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
                record = await decision_record(s, st.url, r.headers["x-request-id"])
            unenforced = record["prediction"]["slo_unenforced"]
            assert f"fewer than {MIN_SAMPLES_TO_REJECT} samples" in unenforced
            assert "no engine predicted to meet the SLO" in unenforced
            assert record["reason"] in ("marginal", "near-tie-p2c")
            await _warm_up(h, s, st.url, MIN_SAMPLES_TO_REJECT)
            before = sum(e.model.prompt_tokens_total for e in st.fleet.engines)
            async with s.post(st.url + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 429
                assert int(r.headers["Retry-After"]) >= 1
                assert r.headers["x-fastroute-engine"] == "none"
                assert "reason=slo-infeasible" in r.headers["x-fastroute-decision"]
                err = (await r.json())["error"]
                rid = r.headers["x-request-id"]
            assert err["code"] == "slo_infeasible"
            assert "slo-infeasible" in err["message"] and "SLO 0.001 s" in err["message"]
            record = await decision_record(s, st.url, rid)
            assert record["reason"] == "slo-infeasible" and record["attempts"] == []
            assert record["status"] == 429
            assert record["error"].startswith("slo-infeasible: no engine predicted to meet")
            assert record["prediction"]["ttft_s"] > 0.001
            assert sum(e.model.prompt_tokens_total for e in st.fleet.engines) == before
            assert all(e.model.num_running + e.model.num_waiting == 0 for e in st.fleet.engines)

            # The same request with a loose objective goes through.
            headers = {"x-fastroute-ttft-slo-ms": "30000", "x-fastroute-tpot-slo-ms": "500"}
            async with s.post(st.url + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()

            for bad in ("0", "abc", "nan", "1e9"):
                headers = {"x-fastroute-tpot-slo-ms": bad}
                async with s.post(st.url + "/v1/chat/completions", json=body, headers=headers) as r:
                    assert r.status == 400
                    err = (await r.json())["error"]
                    assert err["code"] == "invalid_slo"
                    assert "x-fastroute-tpot-slo-ms" in err["message"]

    h.run(main())


def test_calibration_grows_with_traffic_and_shows_in_metrics(h: Harness) -> None:
    """Streamed requests feed TTFT and TBOT into the calibration: /metrics and the
    decision records show growing sample counts; the engine load returns to zero."""

    async def main() -> None:
        async with h.proxy_stack(2, extra=MARGINAL) as st, aiohttp.ClientSession() as s:
            async with s.get(st.url + "/metrics") as r:
                text = await r.text()
            assert _samples(text, "prefill") == 0 and _samples(text, "decode") == 0
            assert 'fastroute_proxy_calibration_coefficient{coef="a1_s",type="h100"}' in text
            counts = []
            for i in range(8):
                body = h.chat_body(
                    f"calibrate {i} " + "word " * 50,
                    stream=True,
                    max_tokens=5,
                    ignore_eos=True,
                    stream_options={"include_usage": True},
                )
                async with s.post(st.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                    events, done = await h.read_sse(r)
                    rid = r.headers["x-request-id"]
                assert done and events[-1]["usage"]["completion_tokens"] == 5
                record = await decision_record(s, st.url, rid)
                counts.append(record["prediction"]["calibration_samples"]["h100"]["prefill"])
            assert counts == sorted(counts) and counts[-1] >= 6 > counts[0]
            async with s.get(st.url + "/metrics") as r:
                text = await r.text()
            assert _samples(text, "prefill") == 8
            assert _samples(text, "decode") == 8
            ctx: ProxyContext = st.ctx
            load = ctx.fleet.load
            assert load is not None and load.observed == 16
            assert not load.state.values[:, :4].any()  # nothing queued or running
            policy = ctx.policies["marginal-cost"]
            assert policy.output_lengths.mean() == pytest.approx(5.0, rel=0.05)

    h.run(main())


def test_calibration_corrects_wrong_nominal_constants(h: Harness) -> None:
    """The proxy believes its engines are A40s (about 6x slower than the emulated H100s):
    in-band timings pull the prefill and decode coefficients to the H100's, and the
    predicted TTFT towards the measured one."""

    async def main() -> None:
        specs = fleet_specs(2, model_name=MODEL, profile="h100", output_lengths=SHORT_OUTPUTS)
        async with EmulatedFleet(specs) as fleet:
            toml = config_toml(fleet.urls, MARGINAL).replace('"h100"', '"a40"')
            config = decode_config(toml, source="a40.toml")
            async with serve_proxy(config) as (app, url, _), aiohttp.ClientSession() as s:
                policy = app.context.policies["marginal-cost"]
                model = policy.calibration.model("a40")
                a1_a40, b0_a40 = model.rls.coef[4], model.rls.coef[1]
                errors = []
                for i in range(16):
                    body = h.chat_body(
                        f"{i} " + "word " * (100 + 100 * i),
                        stream=True,
                        max_tokens=4,
                        ignore_eos=True,
                    )
                    async with s.post(url + "/v1/chat/completions", json=body) as r:
                        assert r.status == 200
                        await h.read_sse(r)
                        rec = await decision_record(s, url, r.headers["x-request-id"])
                    predicted, measured = rec["prediction"]["ttft_s"], rec["timings"]["first_token"]
                    errors.append(abs(predicted - measured) / measured)
        nominal = FleetCalibration().model("h100").rls.coef
        a1, b0 = model.rls.coef[4], model.rls.coef[1]
        assert a1_a40 > 5 * nominal[4] and b0_a40 > 3 * nominal[1]
        assert nominal[4] / 2 < a1 < 2 * nominal[4], (a1, nominal[4])
        assert nominal[1] / 2 < b0 < 2 * nominal[1], (b0, nominal[1])
        assert errors[0] > 1.0 and max(errors[-4:]) < errors[0] / 3, errors

    h.run(main())


def test_scraped_engine_load_counts_requests_the_proxy_did_not_route(h: Harness) -> None:
    """With ``proxy.scrape_engines``, a request sent to engine-0 directly (not through
    the proxy) shows in the engine state, and a long prompt avoids engine-0."""

    async def main() -> None:
        specs = fleet_specs(2, model_name=MODEL, profile="h100", output_lengths=SHORT_OUTPUTS)
        async with EmulatedFleet(specs) as fleet:
            scrape = "[proxy]\nscrape_engines = true\nscrape_interval_s = 0.1\n"
            toml = config_toml(fleet.urls, MARGINAL).replace(
                "[proxy]\n", scrape + "scrape_timeout_s = 0.05\n"
            )
            config = decode_config(toml, source="scrape.toml")
            async with serve_proxy(config) as (app, url, _), aiohttp.ClientSession() as s:
                load = app.context.fleet.load
                assert load is not None and load.scraper is not None
                body = h.chat_body("direct", stream=True, max_tokens=4000, ignore_eos=True)
                async with s.post(fleet.urls[0] + "/v1/chat/completions", json=body) as direct:
                    assert direct.status == 200
                    await direct.content.readline()
                    running = load.state.column("running_seqs")
                    await h.wait_until(
                        lambda: load.engine_state() is not None and running[0] >= 1, timeout=5.0
                    )
                    assert running[1] == 0 and load.state.column("kv_used_tokens")[0] > 0
                    long_text = "lorem ipsum dolor sit amet " * 600
                    for i in range(3):
                        req = h.chat_body(f"{i} {long_text}", max_tokens=2)
                        async with s.post(url + "/v1/chat/completions", json=req) as r:
                            assert r.status == 200
                            assert r.headers["x-fastroute-engine"] == "engine-1"
                    direct.close()

    h.run(main())


def test_pd_with_marginal_cost_end_to_end(h: Harness) -> None:
    """The pair comes from MarginalPairs: prefill then decode, streamed; the record
    has the pair's predictions; prefill steps and decode streams calibrate; an SLO no
    pair meets is a 429."""

    async def main() -> None:
        async with pd_stack(MARGINAL) as (_, ctx, url), aiohttp.ClientSession() as s:
            assert ctx.pd is not None
            assert type(ctx.pd.selector("marginal-cost")).__name__ == "MarginalPairs"
            n = MIN_SAMPLES_TO_REJECT  # then an infeasible SLO is rejected
            for i in range(n):
                body = h.chat_body(f"pd {i}", stream=True, max_tokens=4, ignore_eos=True)
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    events, done = await h.read_sse(r)
                    rid = r.headers["x-request-id"]
                    assert r.headers["x-fastroute-engine"].startswith("decode-")
                assert done and events
                record = await decision_record(s, url, rid)
                assert record["policy"] == "marginal-cost"
                assert record["reason"].startswith("pd:prefill=")
                stages = [(a["stage"], a["outcome"]) for a in record["attempts"]]
                assert stages == [("prefill", "success"), ("decode", "success")]
                pred = record["prediction"]
                assert pred["transfer_s"] > 0 and pred["ttft_s"] > pred["transfer_s"]
                assert "h100" in pred["prefill"]["calibration_samples"]
            model = ctx.policies["marginal-cost"].calibration.model("h100")
            assert model.samples_by_kind["prefill"] == n  # the prefill steps (1 token, JSON)
            assert model.samples_by_kind["decode"] == n  # the decode streams' TBOT
            # on_routed for both engines of each pair: both pools' prefixes are known.
            tree = ctx.policies["marginal-cost"].tree
            p_ids = {int(i) for i in ctx.pd.prefill.engine_ids}
            d_ids = {int(i) for i in ctx.pd.decode.engine_ids}
            matched = tree.match(b"You are terse.\npd 7")
            assert set(matched) & p_ids and set(matched) & d_ids
            for fleet in (ctx.pd.prefill, ctx.pd.decode):
                assert fleet.load is not None and not fleet.load.state.values[:, :4].any()

            headers = {"x-fastroute-ttft-slo-ms": "1"}
            async with s.post(
                url + "/v1/chat/completions", json=h.chat_body("late"), headers=headers
            ) as r:
                assert r.status == 429
                assert (await r.json())["error"]["code"] == "slo_infeasible"
                record = await decision_record(s, url, r.headers["x-request-id"])
            assert record["attempts"] == [] and "slo-infeasible" in record["error"]

    h.run(main())
