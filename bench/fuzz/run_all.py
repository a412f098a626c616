"""Run every fuzz target for a fixed budget and print inputs tried, crashes and hangs.

``python bench/fuzz/run_all.py [--runs N] [--seconds S] [--timeout-s T] [TARGET ...]``

Each target runs in its own process (atheris/libFuzzer, ``-runs`` and
``-max_total_time``), seeded from ``bench/fuzz/corpus/<target>/`` (kept small in the
repo); the inputs it finds go to a temporary directory, not the repo. A crash is an
exception other than the parser's documented error (libFuzzer writes ``crash-*``); a
hang is one input running past ``--timeout-s`` (``timeout-*``). Exit status 1 if any
target crashed or hung.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from targets import TARGETS  # noqa: E402

_DONE = re.compile(rb"Done (\d+) runs in")
_STAT = re.compile(rb"^#(\d+)\s", re.MULTILINE)


def run_target(name: str, runs: int, seconds: int, timeout_s: int) -> dict[str, object]:
    """Fuzz ``name`` once; its inputs tried, crashes, hangs and final coverage."""
    with tempfile.TemporaryDirectory(prefix=f"fuzz-{name}-") as tmp:
        artifacts = Path(tmp) / "artifacts"
        artifacts.mkdir()
        found = Path(tmp) / "corpus"
        found.mkdir()
        cmd = [
            sys.executable,
            str(HERE / "target.py"),
            name,
            f"-runs={runs}",
            f"-max_total_time={seconds}",
            f"-timeout={timeout_s}",
            f"-artifact_prefix={artifacts}/",
            "-print_final_stats=1",
            str(found),
            str(HERE / "corpus" / name),
        ]
        proc = subprocess.run(cmd, capture_output=True, timeout=seconds + 60, check=False)
        out = proc.stderr + proc.stdout
        done = _DONE.search(out)
        stats = _STAT.findall(out)
        tried = int(done.group(1)) if done else (int(stats[-1]) if stats else 0)
        crashes = [p.name for p in artifacts.glob("crash-*")]
        hangs = [p.name for p in artifacts.glob("timeout-*")]
        cov = re.findall(rb"cov: (\d+)", out)
        if crashes or hangs or proc.returncode:
            sys.stderr.write(out.decode(errors="replace")[-4000:])
            kept = Path(tempfile.mkdtemp(prefix=f"fuzz-{name}-artifacts-"))
            for artifact in artifacts.iterdir():
                shutil.copy(artifact, kept)
            sys.stderr.write(f"{name}: crash/hang inputs kept in {kept}\n")
        return {
            "target": name,
            "tried": tried,
            "crashes": len(crashes) + (1 if proc.returncode and not crashes and not hangs else 0),
            "hangs": len(hangs),
            "cov": int(cov[-1]) if cov else 0,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", help=f"some of {', '.join(TARGETS)} (default all)")
    parser.add_argument("--runs", type=int, default=200_000, help="inputs per target at most")
    parser.add_argument("--seconds", type=int, default=60, help="seconds per target at most")
    parser.add_argument("--timeout-s", type=int, default=10, help="one input past this is a hang")
    args = parser.parse_args()
    unknown = sorted(set(args.targets) - set(TARGETS))
    if unknown:
        parser.error(f"unknown targets {unknown}; expected some of {list(TARGETS)}")
    print(f"{'target':<10} {'inputs tried':>12} {'crashes':>8} {'hangs':>6} {'coverage':>9}")
    bad = 0
    for name in args.targets or list(TARGETS):
        row = run_target(name, args.runs, args.seconds, args.timeout_s)
        bad += int(row["crashes"]) + int(row["hangs"])  # type: ignore[call-overload]
        print(
            f"{row['target']:<10} {row['tried']:>12} {row['crashes']:>8} {row['hangs']:>6} "
            f"{row['cov']:>9}",
            flush=True,
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
