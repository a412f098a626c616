"""Real vLLM engines and a real fastroute proxy as subprocesses, for the real-engine tier.

:func:`installed` runs ``setup_vllm.sh`` (cached: a second run takes a second) and returns the
vLLM venv's python and the tiny model. :func:`start_vllm` starts one OpenAI server on a free
loopback port, pinned to one core (two engines share the machine's two cores);
:func:`write_config` writes the config of ``fastroute controller`` and ``fastroute serve`` in
front of the engines, :func:`start_controller` and :func:`start_proxy` start them. Every
process runs in its own session and :func:`stop` kills its whole group. Logs go to files so a
failing start can show why (:func:`tail`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from fastroute.testing.processes import free_port, kill_groups

__all__ = [
    "MODEL",
    "READY_TIMEOUT_S",
    "Installed",
    "Running",
    "Stack",
    "installed",
    "proxy_toml",
    "start_controller",
    "start_proxy",
    "start_vllm",
    "stop",
    "tail",
    "wait_ready",
    "write_config",
]

HERE = Path(__file__).resolve().parent
#: Served model name of every engine.
MODEL = "tiny"
#: Bound on an engine becoming ready. ~35 s on an idle 2-core machine; several minutes when
#: the cores are shared with other work.
READY_TIMEOUT_S = float(os.environ.get("FASTROUTE_REAL_READY_TIMEOUT_S", "600"))
#: The engines' context: short, so the too-long-prompt case is cheap.
MAX_MODEL_LEN = 1024
#: Scrape period of the proxy and the controller, seconds, and the bound on one scrape.
SCRAPE_INTERVAL_S = 1.0
SCRAPE_TIMEOUT_S = 0.9
#: The controller's control period, seconds (short: the tier watches it react).
CONTROLLER_PERIOD_S = 1.0


@dataclass(frozen=True)
class Installed:
    """The vLLM venv's interpreter and the tiny model's directory."""

    python: Path
    model: Path


@dataclass(frozen=True)
class Stack:
    """The tier's config file and the ports it gives the proxy and the controller."""

    config: Path
    proxy_port: int
    controller_port: int | None


@dataclass
class Running:
    """A server: its process (None for one started elsewhere), root URL and log file."""

    proc: subprocess.Popen[bytes] | None
    url: str
    log: Path


def installed() -> Installed:
    """Install (or find cached) vLLM and the model with ``setup_vllm.sh``."""
    out = subprocess.run(
        ["bash", str(HERE / "setup_vllm.sh")],
        check=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ).stdout
    values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return Installed(Path(values["FASTROUTE_REAL_PYTHON"]), Path(values["FASTROUTE_REAL_MODEL"]))


def vllm_env(cpu: str) -> dict[str, str]:
    """The environment of a CPU vLLM engine pinned to ``cpu`` (a core or a range, ``0-1``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    return env | {
        "VLLM_CPU_OMP_THREADS_BIND": cpu,  # "all" is rejected
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_NO_USAGE_STATS": "1",
        # The Responses API stores responses (previous_response_id, retrieve) only with this.
        "VLLM_ENABLE_RESPONSES_API_STORE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }


def start_vllm(
    inst: Installed,
    log_dir: Path,
    *,
    name: str,
    cpu: str,
    extra_args: tuple[str, ...] = (),
    max_model_len: int = MAX_MODEL_LEN,
    kv_cache_bytes: int | None = None,
    extra_env: dict[str, str] | None = None,
) -> Running:
    """Start ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` script fails here).

    ``max_model_len`` bounds prompt + output tokens (the tiny model has 2048 positions);
    ``kv_cache_bytes`` sizes the KV cache (``--kv-cache-memory-bytes``; default
    ``VLLM_CPU_KVCACHE_SPACE``'s 1 GiB, which would override it); ``extra_env`` adds to
    :func:`vllm_env`.
    """
    env = vllm_env(cpu) | (extra_env or {})
    if kv_cache_bytes is not None:
        del env["VLLM_CPU_KVCACHE_SPACE"]  # vLLM reads it as an int: absent, not empty
        extra_args = (*extra_args, "--kv-cache-memory-bytes", str(kv_cache_bytes))
    port = free_port()
    log = log_dir / f"{name}.log"
    cmd = [
        str(inst.python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(inst.model), "--served-model-name", MODEL,
        "--host", "127.0.0.1", "--port", str(port),
        "--enforce-eager", "--dtype", "float32", "--max-model-len", str(max_model_len),
        "--max-num-seqs", "16", "--enable-prompt-tokens-details", *extra_args,
    ]  # fmt: skip
    with log.open("ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True, cwd=log_dir,
        )  # fmt: skip
    return Running(proc, f"http://127.0.0.1:{port}", log)


def proxy_toml(engine_urls: list[str], *, port: int, controller_port: int | None = None) -> str:
    """A proxy that scrapes the engines itself; with ``controller_port``, also the controller
    (same config, same host: it writes the weight table the proxy routes on).

    Engine ``vllm-i`` is ``engine_urls[i]``. Scrapes every second, each bounded by 0.9 s (the
    loaded 2-core machine answers slower than the 0.5 s default at times); two consecutive
    failures eject an engine, so one killed mid-stream is out after one more attempt.
    """
    engines = "".join(
        f'[[engines]]\nname = "vllm-{i}"\nurl = "{url}"\nmodels = ["{MODEL}"]\nkind = "vllm"\n\n'
        for i, url in enumerate(engine_urls)
    )
    table = f"fastroute-real-{uuid.uuid4().hex[:12]}"
    controller = ""
    if controller_port is not None:
        controller = (
            f"[controller]\nport = {controller_port}\nperiod_s = {CONTROLLER_PERIOD_S}\n"
            "solve_time_limit_s = 0.5\n"
            f"scrape_interval_s = {SCRAPE_INTERVAL_S}\nscrape_timeout_s = {SCRAPE_TIMEOUT_S}\n\n"
        )
    return (
        engines
        + controller
        + (
            f'[proxy]\nport = {port}\ntable_name = "{table}-weights"\n'
            f'stats_name = "{table}-stats"\n'
            "scrape_engines = true\n"
            f"scrape_interval_s = {SCRAPE_INTERVAL_S}\nscrape_timeout_s = {SCRAPE_TIMEOUT_S}\n\n"
            "[ejection]\nconsecutive_failures = 2\n"
        )
    )


def write_config(engine_urls: list[str], run_dir: Path, *, controller: bool = True) -> Stack:
    """The tier's config file, on free ports (:func:`proxy_toml`)."""
    ports = Stack(run_dir / "fastroute.toml", free_port(), free_port() if controller else None)
    ports.config.write_text(
        proxy_toml(engine_urls, port=ports.proxy_port, controller_port=ports.controller_port)
    )
    return ports


def _start_fastroute(args: list[str], run_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FASTROUTE_SHM_DIR": str(run_dir)}
    for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        env.pop(key, None)
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "fastroute", "--log-level", "INFO", *args],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True,
        )  # fmt: skip


def start_proxy(stack: Stack, run_dir: Path) -> Running:
    """``python -m fastroute serve --config FILE`` (one worker) on the stack's proxy port."""
    log = run_dir / "proxy.log"
    args = ["serve", "--config", str(stack.config), "--workers", "1"]
    return Running(
        _start_fastroute(args, run_dir, log), f"http://127.0.0.1:{stack.proxy_port}", log
    )


def start_controller(stack: Stack, run_dir: Path) -> Running:
    """``python -m fastroute controller --config FILE`` on the stack's controller port."""
    assert stack.controller_port is not None
    log = run_dir / "controller.log"
    proc = _start_fastroute(["controller", "--config", str(stack.config)], run_dir, log)
    return Running(proc, f"http://127.0.0.1:{stack.controller_port}", log)


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None


def tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def wait_ready(runs: list[Running], path: str, timeout_s: float = READY_TIMEOUT_S) -> float:
    """Wait until every process answers 200 on ``path``; return the seconds it took.

    Raises
    ------
    AssertionError
        A process exited, or one was not ready within ``timeout_s`` (with its log's tail).
    """
    started = time.monotonic()
    pending = list(runs)
    while pending:
        for run in list(pending):
            if run.proc is not None and run.proc.poll() is not None:
                raise AssertionError(f"{run.log.name} exited:\n{tail(run.log)}")
            if _status(run.url + path) == 200:
                pending.remove(run)
        if pending and time.monotonic() - started > timeout_s:
            raise AssertionError(
                f"{pending[0].log.name} not ready within {timeout_s:g} s:\n{tail(pending[0].log)}"
            )
        time.sleep(0.5)
    return time.monotonic() - started


def stop(runs: list[Running]) -> None:
    """Kill each started process's group and reap it."""
    kill_groups([r.proc for r in runs if r.proc is not None])
