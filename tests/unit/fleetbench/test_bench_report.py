"""The goodput tables of the report: per router, and per spec × router for several specs."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import pytest
from bench_specs import write_pd_spec

from fastroute.fleetbench import cli
from fastroute.fleetbench.report import aggregate_report, goodput_table, write_records
from fastroute.fleetbench.runner import RouterResult
from fastroute.fleetbench.spec import load_spec
from fastroute.loadgen.records import RequestRecord
from fastroute.loadgen.summary import summarize


def _record(i: int, ttft_s: float | None, error: str | None = None) -> RequestRecord:
    return RequestRecord(
        session_id=f"s{i}", tenant="t", source="local", model="m", turn=0, sent_at_s=float(i),
        status=200 if error is None else 429, error=error, ttft_s=ttft_s,
        tbot_s=None if error else 0.02, e2e_s=None if error else 1.0, output_tokens=5,
    )  # fmt: skip


def _result(name: str) -> RouterResult:
    records = [_record(0, 0.1), _record(1, 0.1), _record(2, 0.3), _record(3, None, "http_429")]
    records.append(_record(4, None, "deadline"))
    summary = summarize(records, 10.0, ttft_slo_s=0.175, tbot_slo_s=0.0397)
    return RouterResult(router=name, status="ok", summary=summary)


def test_goodput_counts_429s_and_errors_as_misses() -> None:
    lines = goodput_table([_result("mc"), RouterResult(router="lh", status="unavailable")])
    assert "| mc | 0.400 | " in lines[4]  # 2 of 5 sent meet both SLOs
    assert lines[4].endswith("| 5 | 1 (no_code 1) | 1 |")  # sent, 429s by code, other errors
    assert lines[5] == "| lh | unavailable | — | — | — | — | — |"


def test_the_429_column_says_who_refused() -> None:
    records = [_record(0, 0.1), _record(1, None, "http_429"), _record(2, None, "http_429")]
    records[1].error_code = "load_shed"
    records[2].error_code = "overloaded"
    summary = summarize(records, 10.0)
    lines = goodput_table([RouterResult(router="fr", status="ok", summary=summary)])
    assert lines[4].endswith("| 3 | 2 (load_shed 1, overloaded 1) | 0 |")


def test_records_are_written_one_file_per_router_one_line_per_request(tmp_path: Path) -> None:
    records = {"fastroute": [_record(0, 0.1), _record(1, None, "http_429")], "sglang:rr": []}
    records["fastroute"][1].error_code = "load_shed"
    said = write_records(tmp_path, records)
    lines = (tmp_path / "records" / "fastroute.jsonl").read_bytes().splitlines()
    back = [msgspec.json.decode(line, type=RequestRecord) for line in lines]
    assert back == records["fastroute"]
    assert (tmp_path / "records" / "sglang:rr.jsonl").read_bytes() == b""
    assert "fastroute.jsonl (2)" in said


def test_the_aggregate_has_a_row_per_spec_and_a_column_per_router(tmp_path: Path) -> None:
    spec = load_spec(write_pd_spec(tmp_path))
    text = aggregate_report(
        [(spec, [_result("rr"), _result("mc")]), (spec, [_result("mc")])], "fastroute bench x"
    )
    assert "| spec | rr | mc |" in text
    assert "| pd-tiny | 0.400 (1/5) | 0.400 (1/5) |" in text
    assert "| pd-tiny |  | 0.400 (1/5) |" in text


def test_specs_sharing_a_name_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(write_pd_spec(tmp_path))
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["fleet", path, path, "--out", str(tmp_path / "out")])
    assert cli.run(args) == 2
    assert "several specs share a name" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
