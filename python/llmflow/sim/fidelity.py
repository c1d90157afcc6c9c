"""The standing accuracy report: every stored fidelity case, simulated again, against its real runs.

A case is a folder (under `sim/fidelity-cases/` in the repo) holding a `scenario.yaml` (the
workload, the backend: a measured `profile` or a `gpu`/`model`, and one policy: the gateway or
`direct`) and a `real.json` from the real system: `median` (each figure's median over the real
runs), optionally `runs` (each run's figures: their range is the real system's own spread),
`source` and `recorded`. Figures are keyed `<class>.ttft_p50_s`, `<class>.e2e_p99_s` (seconds,
any of p50/p90/p99), `preemptions` and `peak_running` (vLLM's own counter and the peak of its
`num_requests_running` gauge).

`report(root)` simulates each case with its scenario's seed and compares figure by figure. The
simulated preemptions and peak running are counted from the engines' step logs
(`EngineCore.step_log`). The error is the symmetric `ln(sim / real)` against the real median;
`beyond` is how far the simulated figure lies outside the real runs' range (0 inside it). The
issue's goals (issue 30) are checked where they apply: preemptions within 25% and TTFT p50/p99
within 15% of the real median, or inside the real spread where that is wider.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmflow.sim.scenario import load_scenario
from llmflow.sim.workload import build_requests

if TYPE_CHECKING:
    from pathlib import Path

    from llmflow.sim.cluster import Cluster
    from llmflow.sim.engine import StepRecord

__all__ = ["GOALS", "Row", "load_real", "render", "report", "simulate_case"]

# |ln(sim/real)| goals of issue 30, by figure suffix; the rest are reported without a goal
GOALS = {"preemptions": math.log(1.25), "ttft_p50_s": math.log(1.15),
         "ttft_p99_s": math.log(1.15)}
_QS = ("p50", "p90", "p99")


@dataclass(frozen=True)
class Row:
    """One figure of one case."""

    case: str
    metric: str
    real: float  # median of the real runs
    low: float  # smallest of the real runs (= real without runs)
    high: float  # largest
    n_runs: int
    sim: float

    @property
    def error(self) -> float:
        """`ln(sim / real)`: > 0 when the simulator predicts more (slower, more preemptions)."""
        return math.log(max(self.sim, 1e-9) / max(self.real, 1e-9))

    @property
    def spread(self) -> float:
        """`ln(high / low)`: how much the real runs themselves differ."""
        return math.log(max(self.high, 1e-9) / max(self.low, 1e-9))

    @property
    def beyond(self) -> float:
        """How far (|ln|) the simulated figure lies outside the real runs' range; 0 inside."""
        sim = max(self.sim, 1e-9)
        return max(0.0, math.log(max(self.low, 1e-9) / sim), math.log(sim / max(self.high, 1e-9)))

    @property
    def goal(self) -> str:
        """`met (median)`, `met (spread)`, `missed`, or empty where issue 30 sets no goal."""
        bound = next((g for k, g in GOALS.items() if self.metric.endswith(k)), None)
        if bound is None:
            return ""
        if abs(self.error) <= bound:
            return "met (median)"
        return "met (spread)" if self.beyond == 0.0 and self.n_runs > 1 else "missed"


def load_real(folder: Path) -> dict[str, Any]:
    """A case's `real.json`."""
    data: dict[str, Any] = json.loads((folder / "real.json").read_text(encoding="utf-8"))
    return data


def simulate_case(folder: Path) -> dict[str, float]:
    """Simulate the case in `folder` (its scenario's one policy, with its seed): the figures
    `real.json` holds."""
    from llmflow.sim.runner import run_policy

    sc = load_scenario(folder / "scenario.yaml")
    if len(sc.policies) != 1:
        raise ValueError(f"{folder}: a fidelity case runs one policy, found {list(sc.policies)}")
    (name, spec), = sc.policies.items()
    logs: list[list[StepRecord]] = []

    def trace(cluster: Cluster) -> None:
        for backend in cluster.backends:
            log: list[StepRecord] = []
            backend.core.step_log = log
            logs.append(log)

    run = run_policy(sc, name, spec, build_requests(sc), sc.seed, on_cluster=trace)
    out: dict[str, float] = {}
    for cls, summary in run.summary["classes"].items():
        for figure in ("ttft", "e2e"):
            for q, value in summary[f"{figure}_s"].items():
                if value is not None:
                    out[f"{cls}.{figure}_{q}_s"] = value
    out["preemptions"] = float(sum(len(r.preempted) for log in logs for r in log))
    out["peak_running"] = float(max((r.running for log in logs for r in log), default=0))
    return out


def _rows(case: str, real: dict[str, Any], sim: dict[str, float]) -> list[Row]:
    runs = real.get("runs") or [real["median"]]
    rows = []
    for metric, median in real["median"].items():
        if metric not in sim:
            continue
        values = [r[metric] for r in runs if metric in r] or [median]
        rows.append(Row(case, metric, median, min(values), max(values), len(values), sim[metric]))
    return rows


def report(root: Path) -> list[Row]:
    """Every case under `root` (each folder with a `real.json`), simulated and compared.

    Raises:
        FileNotFoundError: no case under `root`.
    """
    folders = sorted(p.parent for p in root.glob("*/real.json"))
    if not folders:
        raise FileNotFoundError(f"no fidelity case (a folder with real.json) under {root}")
    rows: list[Row] = []
    for folder in folders:
        rows += _rows(folder.name, load_real(folder), simulate_case(folder))
    return rows


def _fmt(metric: str, value: float) -> str:
    return f"{value:.3f}" if metric.endswith("_s") else f"{value:.0f}"


def render(rows: list[Row]) -> str:
    """A Markdown table of `rows`, then per case the median and worst |error|."""
    lines = ["| case | figure | real (median) | real runs: range | sim | ln(sim/real) | "
             "real spread ln(high/low) | beyond the range | goal |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rng = f"{_fmt(r.metric, r.low)}-{_fmt(r.metric, r.high)} ({r.n_runs})"
        lines.append(f"| {r.case} | {r.metric} | {_fmt(r.metric, r.real)} | {rng} | "
                     f"{_fmt(r.metric, r.sim)} | {r.error:+.3f} | {r.spread:.3f} | "
                     f"{r.beyond:.3f} | {r.goal} |")
    lines.append("")
    for case in dict.fromkeys(r.case for r in rows):
        errs = [abs(r.error) for r in rows if r.case == case]
        beyond = [r.beyond for r in rows if r.case == case]
        lines.append(f"{case}: median |ln(sim/real)| {statistics.median(errs):.3f}, worst "
                     f"{max(errs):.3f}; median beyond the real range "
                     f"{statistics.median(beyond):.3f}, worst {max(beyond):.3f}")
    return "\n".join(lines)
