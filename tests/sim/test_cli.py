"""`llmflow sim` and `llmflow simserve` commands."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import pytest

from llmflow.sim.cli import add_commands

if TYPE_CHECKING:
    from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmflow")
    add_commands(p.add_subparsers())
    return p


def test_sim_run_prints_table_and_writes_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                 ) -> None:
    args = _parser().parse_args(["sim", "run", "long-report-timeout", "--policy", "llmflow",
                                 "--out", str(tmp_path), "--no-progress"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("scenario: Incident: long report")
    assert {p.name for p in tmp_path.iterdir()} == {"report.json", "report.md",
                                                   "timeseries.png", "ttft_cdf.png"}


def test_unknown_scenario_and_policy_fail_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["sim", "run", "nope"], ["sim", "run", "steady", "--policy", "nope"]):
        args = _parser().parse_args(argv)
        assert args.func(args) == 2
    assert "error:" in capsys.readouterr().err


def test_sim_list_names_every_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parser().parse_args(["sim", "list"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "incidents/marketing-flood" in out
    assert "scenarios/steady" in out


def test_help_is_useful(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["sim", "run", "--help"], ["simserve", "--help"]):
        with pytest.raises(SystemExit):
            _parser().parse_args(argv)
    text = capsys.readouterr().out
    assert "--policy" in text
    assert "--speed" in text
    assert "--port" in text


def test_sim_run_records_a_trace_per_gated_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from llmflow.cli import main

    base = ["sim", "run", "long-report-timeout", "--out", str(tmp_path), "--no-progress",
            "--no-plots"]
    assert main([*base, "--trace", str(tmp_path / "t" / "run.jsonl")]) == 0
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == [
        "run-llmflow.jsonl", "run-seed-gate.jsonl"]
    assert main([*base, "--policy", "llmflow", "--trace", str(tmp_path / "one.jsonl")]) == 0
    assert "one.jsonl" in capsys.readouterr().err
    assert main(["trace", "replay", str(tmp_path / "one.jsonl")]) == 0
    assert capsys.readouterr().out.endswith(" actions: every action matches\n")


def test_sim_run_writes_one_row_per_request(tmp_path: Path) -> None:
    import csv

    from llmflow.cli import main
    from llmflow.request_log import COLUMNS
    from llmflow.sim.scenario import find_scenario, load_scenario
    from llmflow.sim.workload import build_requests

    out = tmp_path / "rows.csv"
    assert main(["sim", "run", "long-report-timeout", "--out", str(tmp_path), "--no-progress",
                 "--no-plots", "--requests-out", str(out)]) == 0
    sent = build_requests(load_scenario(find_scenario("long-report-timeout")))
    by_policy = {
        p: list(csv.DictReader((tmp_path / f"rows-{p}.csv").read_text().splitlines()))
        for p in ("direct", "llmflow")}
    for rows in by_policy.values():
        assert tuple(rows[0]) == COLUMNS
        # the scenario's four requests: the report at 5 s, three short ones from 20 s
        assert [r["class"] for r in rows] == ["report", "short", "short", "short"]
        assert [float(r["arrival_s"]) for r in rows] == pytest.approx(sent.t.tolist())
        assert [int(r["prompt_tokens"]) for r in rows] == sent.prompt.tolist()
        assert {r["backend"] for r in rows} == {"a100"}
    report = by_policy["llmflow"][0]
    # the 45 s total deadline cuts the report at 5 + 45 s, with its partial text
    assert (report["outcome"], report["reason"]) == ("truncated", "deadline")
    assert float(report["end_s"]) == pytest.approx(50.0, abs=0.01)
    assert 0 < int(report["output_tokens"]) < int(report["max_tokens"]) == 3000
    for r in by_policy["llmflow"][1:]:  # the short ones get their first token only after the cut
        assert r["outcome"] == "completed"
        assert float(r["admitted_s"]) <= float(r["first_token_s"]) <= float(r["end_s"])
        assert float(r["first_token_s"]) > 50.0
    direct = by_policy["direct"][0]
    assert direct["outcome"] == "completed"  # no deadline without a gateway
    assert int(direct["output_tokens"]) == 3000


def test_requests_out_refuses_what_it_cannot_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from llmflow.cli import main

    base = ["sim", "run", "long-report-timeout", "--out", str(tmp_path), "--no-progress",
            "--no-plots", "--policy", "llmflow", "--requests-out"]
    assert main([*base, str(tmp_path / "rows.txt")]) == 2
    assert ".csv or .parquet" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as on a machine without it
    assert main([*base, str(tmp_path / "rows.parquet")]) == 2
    assert "pip install pyarrow" in capsys.readouterr().err
    assert not (tmp_path / "report.json").exists()  # refused before the run
