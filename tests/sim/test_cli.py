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
