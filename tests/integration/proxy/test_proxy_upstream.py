"""The proxy's upstream client (``fastroute.proxy.http.http1``) against emulated engines."""

from __future__ import annotations

import aiohttp
from proxy_harness import Harness

from fastroute.proxy.http import http1


def test_streamed_and_non_streamed_over_one_keepalive_connection(h: Harness) -> None:
    """JSON and SSE requests go through the new client and reuse one engine connection."""

    async def main() -> None:
        async with h.proxy_stack(1) as stack, aiohttp.ClientSession() as s:
            url = stack.url + "/v1/chat/completions"
            for i in range(3):
                async with s.post(url, json=h.chat_body(f"json {i}")) as r:
                    assert r.status == 200, await r.text()
                    assert r.content_type == "application/json"
                    data = await r.json()
                    assert data["choices"][0]["message"]["content"]
                    assert r.headers["x-fastroute-engine"] == "engine-0"
                body = h.chat_body(f"sse {i}", stream=True, max_tokens=6, ignore_eos=True)
                async with s.post(url, json=body) as r:
                    assert r.status == 200, await r.text()
                    assert r.content_type == "text/event-stream"
                    events, done = await h.read_sse(r)
                    assert done and not any("error" in e for e in events)
                    text = "".join(
                        e["choices"][0]["delta"].get("content") or ""
                        for e in events
                        if e.get("choices")
                    )
                    assert text
            upstream = stack.ctx.upstream
            assert upstream is not None
            pools = list(upstream._pools.values())
            assert len(pools) == 1 and isinstance(pools[0], http1.HostPool)
            # Six sequential requests, one connection: keep-alive reuse through the proxy.
            assert pools[0].opened == 1 and pools[0].idle == 1

    h.run(main())


def test_client_gone_mid_stream_drops_the_upstream_connection(h: Harness) -> None:
    """A half-read stream's connection is closed, not pooled; the next request works."""

    async def main() -> None:
        async with h.proxy_stack(1) as stack:
            url = stack.url + "/v1/chat/completions"
            body = h.chat_body("long", stream=True, max_tokens=2000, ignore_eos=True)
            async with aiohttp.ClientSession() as s:
                r = await s.post(url, json=body)
                assert r.status == 200
                assert (await r.content.readline()).startswith(b"data: ")
                r.close()  # the client goes away mid-stream
            upstream = stack.ctx.upstream
            assert upstream is not None
            pool = next(iter(upstream._pools.values()))
            await h.wait_until(lambda: pool.size == 0)
            assert pool.idle == 0
            async with aiohttp.ClientSession() as s:
                async with s.post(url, json=h.chat_body("again")) as r:
                    assert r.status == 200, await r.text()
            assert pool.opened == 2

    h.run(main())
