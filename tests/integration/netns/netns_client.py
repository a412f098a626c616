"""A client run inside a host of the namespace topology (``ip netns exec … python this.py``).

    netns_client.py wait URL [URL …]          every URL answers 200 within the bound
    netns_client.py chat PROXY_URL MODEL N    N streamed chats with the official openai client
    netns_client.py refused URL               a connection to URL is refused or unreachable
    netns_client.py get URL                   the body of GET URL
    netns_client.py load PROXY_URL MODEL S C  C threads of streamed chats for S seconds,
                                              0.25 s apart (well under the fleet's capacity)

Prints one JSON line: what happened. Each command is bounded (``WAIT_S``, the client timeout).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request

WAIT_S = 90.0
#: Pause between one load thread's requests, seconds.
THINK_S = 0.25


def _get(url: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait(urls: list[str]) -> dict[str, object]:
    deadline = time.monotonic() + WAIT_S
    pending = list(urls)
    while pending and time.monotonic() < deadline:
        try:
            if _get(pending[0])[0] == 200:
                pending.pop(0)
                continue
        except OSError:
            pass
        time.sleep(0.2)
    return {"ready": not pending, "pending": pending}


def chat(proxy_url: str, model: str, n: int) -> dict[str, object]:
    import openai

    client = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key="none", timeout=30.0, max_retries=0)
    ok, failures, engines = 0, [], []
    for i in range(n):
        try:
            raw = client.chat.completions.with_raw_response.create(
                model=model, stream=True, max_tokens=8,
                messages=[{"role": "user", "content": f"hello from the namespace, turn {i}"}],
                extra_headers={"x-session-id": f"netns-{i % 4}"},
            )  # fmt: skip
            text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
            engines.append(raw.headers.get("x-fastroute-engine"))
            ok += bool(text)
        except openai.OpenAIError as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
    return {"ok": ok, "failures": failures, "engines": engines}


def load(proxy_url: str, model: str, seconds: float, concurrency: int) -> dict[str, object]:
    """Steady streamed chats from ``concurrency`` threads for ``seconds``; counts and failures."""
    import threading

    import openai

    client = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key="none", timeout=30.0, max_retries=0)
    deadline = time.monotonic() + seconds
    ok, failures, lock = [0], [], threading.Lock()

    def worker(k: int) -> None:
        i = 0
        while time.monotonic() < deadline:
            i += 1
            time.sleep(THINK_S)
            try:
                stream = client.chat.completions.create(
                    model=model, stream=True, max_tokens=16,
                    messages=[{"role": "user", "content": f"load {k}-{i}"}],
                )  # fmt: skip
                text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                with lock:
                    ok[0] += bool(text)
            except openai.OpenAIError as exc:
                with lock:
                    failures.append(f"{time.monotonic() - deadline + seconds:.1f}s "
                                    f"{type(exc).__name__}: {exc}")  # fmt: skip

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"ok": ok[0], "failures": failures}


def refused(url: str) -> dict[str, object]:
    try:
        _get(url, timeout_s=2.0)
    except OSError as exc:
        return {"refused": True, "error": str(exc)}
    return {"refused": False}


def main(argv: list[str]) -> None:
    command, args = argv[0], argv[1:]
    if command == "wait":
        out = wait(args)
    elif command == "chat":
        out = chat(args[0], args[1], int(args[2]))
    elif command == "load":
        out = load(args[0], args[1], float(args[2]), int(args[3]))
    elif command == "refused":
        out = refused(args[0])
    elif command == "get":
        status, body = _get(args[0])
        out = {"status": status, "body": body.decode(errors="replace")}
    else:
        raise SystemExit(f"unknown command {command!r}")
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
