"""The standing accuracy report (`llmflow sim fidelity`): stored cases against their real runs."""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import pytest

from llmflow.sim.cli import add_commands
from llmflow.sim.fidelity import Row, render, report, simulate_case
from llmflow.sim.runner import run_policy
from llmflow.sim.scenario import load_scenario
from llmflow.sim.workload import build_requests

CASES = Path(__file__).resolve().parents[2] / "sim" / "fidelity-cases"
STARVED = CASES / "vllm-cpu-kv-starved"


def _case(tmp_path: Path, real: dict[str, object]) -> Path:
    folder = tmp_path / "cases" / "starved"
    folder.mkdir(parents=True)
    for name in ("scenario.yaml", "profile.yaml"):
        shutil.copy(STARVED / name, folder / name)
    (folder / "real.json").write_text(json.dumps(real), encoding="utf-8")
    return folder.parent


def test_each_figure_is_compared_with_the_real_median_and_range(tmp_path: Path) -> None:
    sim = simulate_case(STARVED)
    p50, p99, pre = sim["starved.ttft_p50_s"], sim["starved.ttft_p99_s"], sim["preemptions"]
    real = {"median": {"starved.ttft_p50_s": p50 * 1.1, "starved.ttft_p99_s": p99 * 1.5,
                       "preemptions": pre * 2, "starved.e2e_p90_s": 1.0},
            "runs": [{"starved.ttft_p50_s": p50 * 1.1, "starved.ttft_p99_s": p99 * 0.9,
                      "preemptions": pre * 1.8},
                     {"starved.ttft_p50_s": p50 * 1.2, "starved.ttft_p99_s": p99 * 2.0,
                      "preemptions": pre * 2.2}]}
    rows = {r.metric: r for r in report(_case(tmp_path, real))}
    assert list(rows) == ["starved.ttft_p50_s", "starved.ttft_p99_s", "preemptions",
                          "starved.e2e_p90_s"]
    assert rows["starved.ttft_p50_s"].error == pytest.approx(-math.log(1.1))
    assert rows["starved.ttft_p50_s"].goal == "met (median)"  # within ln 1.15 of the median
    assert rows["starved.ttft_p99_s"].goal == "met (spread)"  # x0.67 of the median, in range
    assert rows["starved.ttft_p99_s"].spread == pytest.approx(math.log(2.0 / 0.9))
    assert rows["preemptions"].goal == "missed"  # half the median, below the range
    assert rows["preemptions"].beyond == pytest.approx(math.log(1.8))
    assert rows["starved.e2e_p90_s"].goal == ""  # no goal; no runs: the range is the median
    assert (rows["starved.e2e_p90_s"].low, rows["starved.e2e_p90_s"].n_runs) == (1.0, 1)


def test_preemptions_and_peak_running_come_from_the_step_logs() -> None:
    # the same run's own summary (the cluster's counter, the sampled gauges) agrees
    sc = load_scenario(STARVED / "scenario.yaml")
    (name, spec), = sc.policies.items()
    summary = run_policy(sc, name, spec, build_requests(sc), sc.seed).summary
    sim = simulate_case(STARVED)
    assert sim["preemptions"] == summary["preemptions"] > 0
    assert summary["peak_running"] <= sim["peak_running"] <= 16  # max_num_seqs


def test_the_table_names_every_case_and_figure() -> None:
    rows = [Row("a", "x.ttft_p50_s", 2.0, 1.0, 4.0, 3, 1.0),
            Row("a", "preemptions", 10.0, 10.0, 10.0, 1, 12.0)]
    text = render(rows)
    assert "| a | x.ttft_p50_s | 2.000 | 1.000-4.000 (3) | 1.000 | -0.693 | 1.386 | 0.000 | " \
           "met (spread) |" in text
    assert "| a | preemptions | 10 | 10-10 (1) | 12 | +0.182 | 0.000 | 0.182 | met (median) |" \
           in text
    assert text.endswith("a: median |ln(sim/real)| 0.438, worst 0.693; median beyond the real "
                         "range 0.091, worst 0.182")


def test_the_command_replays_the_stored_cases(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser(prog="llmflow")
    add_commands(p.add_subparsers())
    out = tmp_path / "table.md"
    args = p.parse_args(["sim", "fidelity", "--out", str(out)])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert out.read_text(encoding="utf-8") == printed
    for case in sorted(c.parent.name for c in CASES.glob("*/real.json")):
        real = json.loads((CASES / case / "real.json").read_text(encoding="utf-8"))
        for metric in real["median"]:
            assert f"| {case} | {metric} |" in printed
    args = p.parse_args(["sim", "fidelity", "--cases", str(tmp_path)])
    assert args.func(args) == 2
    assert "no fidelity case" in capsys.readouterr().err
