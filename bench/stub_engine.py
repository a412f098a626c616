"""An instant-response OpenAI-compatible engine for proxy benchmarks (not a pytest file).

A raw ``asyncio.Protocol`` HTTP/1.1 server on uvloop, one process, no framework, so
that the engine's own CPU cost per request is as small as the router's is large:

* ``POST /v1/chat/completions`` and ``POST /v1/completions``: a fixed JSON answer, or
  with ``"stream": true`` an SSE body of ``--tokens`` chunk events (overridable per
  request by ``max_tokens``) plus ``[DONE]``, sent in ``--stream-writes`` transport
  writes (chunked transfer encoding, keep-alive): at once, or ``--write-interval-ms``
  apart (paced like a real engine's decode steps, so a router sees one wake-up per write);
* ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (a few vLLM-style lines, so
  routers that scrape engines find what they expect); any other ``GET`` answers
  ``200 {}`` (routers probe ``/get_server_info`` and the like at start).

The request body is not parsed beyond a byte search for ``"stream": true`` and
``max_tokens``. Request bodies may come with ``Content-Length`` or chunked.

Run: ``.venv/bin/python bench/stub_engine.py --port 0`` prints
``stub listening on http://127.0.0.1:PORT`` once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import sys
import time

import uvloop

MODEL = "stub-model"
_MAX_TOKENS = re.compile(rb'"max_(?:completion_)?tokens"\s*:\s*(\d+)')
_STREAM = re.compile(rb'"stream"\s*:\s*true')
_KEEP_ALIVE = b"Connection: keep-alive\r\n"


def _json_response(body: bytes, status: bytes = b"200 OK") -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n" + _KEEP_ALIVE + b"\r\n" + body
    )


_COMPLETION = (
    b'{"id":"cmpl-stub","object":"chat.completion","created":1700000000,"model":"'
    + MODEL.encode()
    + b'","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},'
    b'"finish_reason":"stop"}],"usage":{"prompt_tokens":8,"completion_tokens":1,'
    b'"total_tokens":9}}'
)
_MODELS = (
    b'{"object":"list","data":[{"id":"' + MODEL.encode() + b'","object":"model",'
    b'"created":1700000000,"owned_by":"stub","max_model_len":8192}]}'
)
_METRICS = (
    "# TYPE vllm:num_requests_running gauge\n"
    f'vllm:num_requests_running{{model_name="{MODEL}"}} 0.0\n'
    "# TYPE vllm:num_requests_waiting gauge\n"
    f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0.0\n'
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.0\n'
).encode()
_TOKEN_EVENT = (
    b'data: {"id":"cmpl-stub","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"' + MODEL.encode() + b'","choices":[{"index":0,"delta":{"content":"tok"},'
    b'"finish_reason":null}]}\n\n'
)
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n" + _KEEP_ALIVE + b"\r\n"
)
_SSE_DONE = b"data: [DONE]\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class StubProtocol(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; requests are answered in arrival order."""

    __slots__ = ("server", "transport", "buf")

    def __init__(self, server: StubServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buf = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf = self.buf + data if self.buf else data
        while self.buf:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end]
            rest = end + 4
            lines = head.split(b"\r\n")
            try:
                method, path, _ = lines[0].split(b" ", 2)
            except ValueError:
                self._fail()
                return
            length = 0
            chunked = False
            close = False
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"transfer-encoding" and b"chunked" in value.lower():
                    chunked = True
                elif name == b"connection" and value.strip().lower() == b"close":
                    close = True
            if chunked:
                parsed = _dechunk(self.buf, rest)
                if parsed is None:
                    return
                body, consumed = parsed
            else:
                if len(self.buf) < rest + length:
                    return
                body, consumed = self.buf[rest : rest + length], rest + length
            self.buf = self.buf[consumed:]
            self._respond(method, path, body)
            if close:
                assert self.transport is not None
                self.transport.close()
                return

    def _fail(self) -> None:
        assert self.transport is not None
        self.transport.write(_json_response(b'{"error":"bad request"}', b"400 Bad Request"))
        self.transport.close()

    def _respond(self, method: bytes, path: bytes, body: bytes) -> None:
        transport = self.transport
        assert transport is not None
        server = self.server
        server.requests += 1
        path = path.split(b"?", 1)[0]
        if method == b"POST" and path in (b"/v1/chat/completions", b"/v1/completions"):
            if _STREAM.search(body) is None:
                transport.write(server.completion_response)
                return
            match = _MAX_TOKENS.search(body)
            n = int(match.group(1)) if match else server.tokens
            server.tokens_sent += n
            writes = max(1, min(server.stream_writes, n))
            per = -(-n // writes)
            transport.write(_SSE_HEAD)
            sent = 0
            writes_out: list[bytes] = []
            while sent < n:
                k = min(per, n - sent)
                sent += k
                tail = _SSE_DONE if sent >= n else b""
                out = _chunk(_TOKEN_EVENT * k + tail)
                writes_out.append(out + b"0\r\n\r\n" if tail else out)
            if n == 0:
                writes_out.append(_chunk(_SSE_DONE) + b"0\r\n\r\n")
            interval_s = server.write_interval_s
            if interval_s <= 0:
                for out in writes_out:
                    transport.write(out)
                return
            # Paced: the first write now, the others interval_s apart (one timer each,
            # bounded by the stream's length); a closed connection drops the rest.
            loop = asyncio.get_running_loop()
            for i, out in enumerate(writes_out):
                loop.call_later(i * interval_s, _write_unless_closed, transport, out)
        elif method == b"POST" and path == b"/v1/traces":  # an OTLP/HTTP sink: traced routers
            transport.write(server.empty_response)
        elif method == b"GET" and path == b"/v1/models":
            transport.write(server.models_response)
        elif method == b"GET" and path == b"/metrics":
            transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                b"Content-Length: %d\r\n%b\r\n%b" % (len(_METRICS), _KEEP_ALIVE, _METRICS)
            )
        elif method == b"GET":
            transport.write(server.empty_response)
        else:
            transport.write(_json_response(b'{"error":"not found"}', b"404 Not Found"))


def _write_unless_closed(transport: asyncio.Transport, data: bytes) -> None:
    if not transport.is_closing():
        transport.write(data)


def _dechunk(buf: bytes, pos: int) -> tuple[bytes, int] | None:
    """Decode a chunked body starting at ``pos``; None if it is not complete yet."""
    parts = []
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(buf[pos:eol].split(b";", 1)[0], 16)
        start = eol + 2
        if size == 0:
            end = buf.find(b"\r\n\r\n", eol)  # trailers, usually none
            if buf[start : start + 2] == b"\r\n":
                return b"".join(parts), start + 2
            if end < 0:
                return None
            return b"".join(parts), end + 4
        if len(buf) < start + size + 2:
            return None
        parts.append(buf[start : start + size])
        pos = start + size + 2


class StubServer:
    """Configuration and counters shared by the connections."""

    def __init__(self, tokens: int, stream_writes: int, write_interval_s: float = 0.0) -> None:
        self.tokens = tokens
        self.stream_writes = stream_writes
        self.write_interval_s = write_interval_s
        self.requests = 0
        self.tokens_sent = 0
        self.completion_response = _json_response(_COMPLETION)
        self.models_response = _json_response(_MODELS)
        self.empty_response = _json_response(b'{"status":"ok"}')


async def serve(
    host: str, port: int, tokens: int, stream_writes: int, write_interval_s: float = 0.0
) -> None:
    """Serve until SIGTERM/SIGINT."""
    loop = asyncio.get_running_loop()
    state = StubServer(tokens, stream_writes, write_interval_s)
    server = await loop.create_server(lambda: StubProtocol(state), host, port, backlog=1024)
    bound = server.sockets[0].getsockname()
    print(f"stub listening on http://{bound[0]}:{bound[1]}", flush=True)
    stop = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
    started = time.monotonic()
    await stop
    server.close()
    print(
        f"stub served {state.requests} requests, {state.tokens_sent} streamed tokens "
        f"in {time.monotonic() - started:.1f} s",
        file=sys.stderr,
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--tokens", type=int, default=100, help="tokens per stream (default)")
    parser.add_argument(
        "--stream-writes", type=int, default=4, help="transport writes per stream (default 4)"
    )
    parser.add_argument(
        "--write-interval-ms",
        type=float,
        default=0.0,
        help="milliseconds between a stream's writes (default 0: all at once)",
    )
    args = parser.parse_args(argv)
    uvloop.run(
        serve(args.host, args.port, args.tokens, args.stream_writes, args.write_interval_ms / 1000)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
