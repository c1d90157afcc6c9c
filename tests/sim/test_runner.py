"""Runs as a whole: determinism, one end state per request, Little's law, reports and plots."""

from __future__ import annotations

import json
from pathlib import Path

from llmflow.sim.metrics import STATES
from llmflow.sim.report import render_table, write_reports
from llmflow.sim.runner import run_scenario
from llmflow.sim.scenario import find_scenario, load_scenario
from llmflow.sim.workload import build_requests

SCENARIOS = Path(__file__).resolve().parents[2] / "sim" / "scenarios"


def test_same_seed_same_numbers_other_seed_other_numbers() -> None:
    sc = load_scenario(SCENARIOS / "burst.yaml")
    a, _ = run_scenario(sc, ["direct", "llmflow"], seed=3)
    b, _ = run_scenario(sc, ["direct", "llmflow"], seed=3)
    c, _ = run_scenario(sc, ["direct", "llmflow"], seed=4)
    for r in (a, b, c):
        for p in r["policies"].values():
            p.pop("wall_s")
    assert json.dumps(a) == json.dumps(b)
    assert render_table(a) != render_table(c)


def test_every_request_ends_in_exactly_one_state_and_little_holds() -> None:
    sc = load_scenario(SCENARIOS / "fairness.yaml")
    report, _ = run_scenario(sc)
    for name, pol in report["policies"].items():
        for cls, c in pol["classes"].items():
            assert sum(c[s] for s in STATES) == c["arrived"], (name, cls)
        assert sum(c["arrived"] for c in pol["classes"].values()) == report["requests"]
        assert pol["littles_law"]["rel_error"] < 1e-9, name


def test_policies_see_the_same_requests() -> None:
    sc = load_scenario(SCENARIOS / "steady.yaml")
    a, b = build_requests(sc, 1), build_requests(sc, 1)
    assert (a.t == b.t).all()
    assert (a.prompt == b.prompt).all()
    assert len(a) > 1000


def test_reports_and_plots_are_written(tmp_path: Path) -> None:
    sc = load_scenario(find_scenario("steady"))
    report, runs = run_scenario(sc, ["direct", "llmflow"])
    write_reports(sc, report, tmp_path)
    from llmflow.sim.plots import write_plots

    write_plots(runs, tmp_path, sc.title)
    data = json.loads((tmp_path / "report.json").read_text())
    chat = data["policies"]["llmflow"]["classes"]["chat"]
    assert set(chat["ttft_s"]) == {"p50", "p90", "p99"}
    assert set(chat["queue_wait_s"]) == {"p50", "p99"}
    assert "## Verdicts" in (tmp_path / "report.md").read_text()
    for png in ("timeseries.png", "ttft_cdf.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
