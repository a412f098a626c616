"""A tiny OTLP/HTTP traces receiver: the tracing tests' collector, and the docs' example one.

It takes ``POST /v1/traces`` (protobuf ``ExportTraceServiceRequest``, what the OTLP/HTTP
exporters send) and keeps the decoded spans; ``python -m fastroute.testing.otlp --port 4318``
prints one line per span (trace id, span id, parent, service, name, attributes), so the
"Tracing" example of docs/operations.md runs without a collector. It is not a collector:
no gRPC, no JSON encoding, nothing stored.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from fastroute.testing.servers import serve_app

__all__ = ["OtlpSpan", "OtlpReceiver", "serve_otlp_receiver"]

#: Most spans a receiver keeps (then the oldest are dropped).
MAX_KEPT_SPANS = 100_000


@dataclass(frozen=True)
class OtlpSpan:
    """One span as received: ids in hex, the resource's ``service.name``, attributes."""

    trace_id: str
    span_id: str
    parent_span_id: str
    service: str
    name: str
    attributes: dict[str, Any]

    def line(self) -> str:
        """A one-line rendering (the printing receiver's output)."""
        attrs = " ".join(f"{k}={v}" for k, v in sorted(self.attributes.items()))
        parent = self.parent_span_id or "-" * 16
        return f"{self.trace_id} {self.span_id} <- {parent} [{self.service}] {self.name} {attrs}"


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind is not None else None


@dataclass
class OtlpReceiver:
    """The spans received so far (``spans``); ``on_span`` is called with each one."""

    spans: list[OtlpSpan] = field(default_factory=list)
    on_span: Callable[[OtlpSpan], None] | None = None

    async def handle(self, request: web.Request) -> web.Response:
        """``POST /v1/traces``: decode, keep, answer an empty protobuf success."""
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        if request.content_type != "application/x-protobuf":
            return web.Response(status=415, text="only application/x-protobuf is taken")
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        for resource in message.resource_spans:
            service = next(
                (_value(a.value) for a in resource.resource.attributes if a.key == "service.name"),
                "",
            )
            for scope in resource.scope_spans:
                for span in scope.spans:
                    self._keep(
                        OtlpSpan(
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            service=service,
                            name=span.name,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                        )
                    )
        return web.Response(status=200, content_type="application/x-protobuf", body=b"")

    def _keep(self, span: OtlpSpan) -> None:
        if len(self.spans) >= MAX_KEPT_SPANS:
            del self.spans[: MAX_KEPT_SPANS // 2]
        self.spans.append(span)
        if self.on_span is not None:
            self.on_span(span)


@asynccontextmanager
async def serve_otlp_receiver(
    receiver: OtlpReceiver | None = None,
) -> AsyncIterator[tuple[str, OtlpReceiver]]:
    """Serve a receiver on a free port of 127.0.0.1: (its ``/v1/traces`` URL, receiver)."""
    receiver = receiver or OtlpReceiver()
    app = web.Application()
    app.router.add_post("/v1/traces", receiver.handle)
    async with serve_app(app) as url:
        yield url + "/v1/traces", receiver


async def _print_forever(port: int) -> None:
    receiver = OtlpReceiver(on_span=lambda span: print(span.line(), flush=True))
    app = web.Application()
    app.router.add_post("/v1/traces", receiver.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print(f"OTLP/HTTP receiver on http://127.0.0.1:{port}/v1/traces", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    """``python -m fastroute.testing.otlp [--port 4318]``: print spans until Ctrl-C."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=4318, help="loopback port (default 4318)")
    args = parser.parse_args(argv)
    try:
        asyncio.run(_print_forever(args.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
