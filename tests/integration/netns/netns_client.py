"""A client run inside a host of the namespace topology (``ip netns exec … python this.py``).

    netns_client.py wait URL [URL …]          every URL answers 200 within the bound
    netns_client.py chat PROXY_URL MODEL N    N streamed chats with the official openai client
    netns_client.py refused URL               a connection to URL is refused or unreachable
    netns_client.py get URL                   the body of GET URL

Prints one JSON line: what happened. Each command is bounded (``WAIT_S``, the client timeout).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request

WAIT_S = 90.0


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
