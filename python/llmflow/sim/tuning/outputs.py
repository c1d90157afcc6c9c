"""What `llmflow sim tune` leaves in its output folder, from the finished study.

`trials.csv` and `trials.md` (one row per trial: the config values it ran, objectives, the
constraints' worst seeds, feasible, on the Pareto front), `tuned.yaml` (the chosen trial's full
config, which `llmflow serve --config` loads unchanged) and `holdout.md` (tuned against the
starting config on held-out seeds); `pareto.py` draws `pareto.png`. The chosen trial is the
feasible one best on the first objective (near-ties broken by the next ones); the others on the
front are in the tables.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from statistics import fmean
from typing import TYPE_CHECKING, Any

import yaml

from llmflow._core import Runtime
from llmflow.config import load_settings
from llmflow.sim.tuning.space import get_path

if TYPE_CHECKING:
    from pathlib import Path

    import optuna

    from llmflow.sim.tuning.plan import Goals
    from llmflow.sim.tuning.space import Space

__all__ = [
    "Row",
    "choose",
    "render_holdout",
    "rows_of",
    "write_tables",
    "write_tuned",
]


TIE = 0.001  # relative: objective values this close to the best are tied on it


@dataclass
class Row:
    """One trial, as the tables show it."""

    number: int
    state: str  # COMPLETE, FAIL, ...
    config: dict[str, Any]  # varied path -> value it ran
    objectives: list[float] | None  # means over seeds
    constraints: list[float]  # each constraint's metric on its worst seed
    feasible: bool
    label: str = ""  # "defaults" for the starting config
    wall_s: float = 0.0
    error: str = ""  # why a trial failed
    note: str = ""  # why it stopped before its last seed
    pareto: bool = False
    seeds: dict[str, list[float]] = field(default_factory=dict)


def rows_of(study: optuna.Study, goals: Goals) -> list[Row]:
    """The study's trials as rows, with the Pareto front (over the objectives, among feasible
    trials) marked."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get("surplus"):  # asked past --trials by a worker on another machine
            continue
        seeds = t.user_attrs.get("seeds", {})
        done = t.values is not None and bool(seeds)
        cons = [c.worst(seeds[c.metric.name]) for c in goals.constraints] if done else []
        rows.append(
            Row(
                t.number,
                t.state.name,
                t.user_attrs.get("config", {}),
                list(t.values) if done and t.values is not None else None,
                cons,
                done and all(v <= 0 for v in t.constraints.values()),
                t.user_attrs.get("label", ""),
                t.user_attrs.get("wall_s", 0.0),
                t.user_attrs.get("error", ""),
                t.user_attrs.get("note", ""),
                seeds=seeds,
            )
        )
    signs = [1.0 if o.direction == "minimize" else -1.0 for o in goals.objectives]
    feasible = [r for r in rows if r.feasible and r.objectives is not None]
    for r in feasible:
        r.pareto = not any(_dominates(q, r, signs) for q in feasible)
    return rows


def _dominates(a: Row, b: Row, signs: list[float]) -> bool:
    x = [s * v for s, v in zip(signs, a.objectives or [], strict=True)]
    y = [s * v for s, v in zip(signs, b.objectives or [], strict=True)]
    return all(p <= q for p, q in zip(x, y, strict=True)) and x != y


def choose(rows: list[Row], goals: Goals) -> Row | None:
    """The feasible trial best on the first objective, then the next ones; None if no trial
    met every constraint.

    Trials within `TIE` of the best on an objective count as tied on it (a mean over a few
    seeds is not finer than that), so the next objective decides between them; the last ties
    go to the earliest trial.
    """
    pool = [r for r in rows if r.feasible and r.objectives is not None]
    if not pool:
        return None
    for i, o in enumerate(goals.objectives):
        sign = 1.0 if o.direction == "minimize" else -1.0
        best = min(sign * (r.objectives or [])[i] for r in pool)
        slack = TIE * abs(best)
        pool = [r for r in pool if sign * (r.objectives or [])[i] <= best + slack]
    return min(pool, key=lambda r: r.number)


def _fmt(v: Any) -> str:
    if v is None:
        return "off"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return str(int(v)) if v.is_integer() and abs(v) < 1e12 else f"{v:.4g}"
    return str(v)


def _paths(rows: list[Row]) -> list[str]:
    return list(dict.fromkeys(p for r in rows for p in r.config))


def _header(rows: list[Row], goals: Goals) -> list[str]:
    return [
        "trial",
        *_paths(rows),
        *(f"{o.name} ({o.direction[:3]}, mean)" for o in goals.objectives),
        *(f"{c.text} (worst)" for c in goals.constraints),
        "seeds",
        "feasible",
        "pareto",
        "wall s",
        "note",
    ]


def _cells(r: Row, paths: list[str], goals: Goals, fmt: Any) -> list[str]:
    objs = r.objectives or [math.nan] * len(goals.objectives)
    cons = r.constraints or [math.nan] * len(goals.constraints)
    state = r.state.lower() if r.state != "COMPLETE" else ""
    note = "; ".join(n for n in (r.label, state, r.error, r.note) if n)
    ran = min((len(v) for v in r.seeds.values()), default=0)
    return [
        str(r.number),
        *(fmt(r.config.get(p, math.nan)) for p in paths),
        *(fmt(v) for v in objs),
        *(fmt(v) for v in cons),
        str(ran),
        "yes" if r.feasible else "no",
        "yes" if r.pareto else "",
        f"{r.wall_s:.1f}",
        note,
    ]


def write_tables(rows: list[Row], goals: Goals, out: Path, intro: str) -> list[Path]:
    """`trials.csv` (full precision) and `trials.md` (rounded, with `intro` above the table)."""
    head, paths = _header(rows, goals), _paths(rows)
    csv_path, md_path = out / "trials.csv", out / "trials.md"
    with csv_path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(head)
        w.writerows(_cells(r, paths, goals, lambda v: "off" if v is None else str(v)) for r in rows)
    lines = [intro, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cells(r, paths, goals, _fmt)) + " |" for r in rows]
    md_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [csv_path, md_path]


def write_tuned(
    space: Space, row: Row, goals: Goals, out: Path, header: list[str], scheduling: str
) -> Path:
    """`tuned.yaml`: a full llmflow config (every section but `backends`), checked by loading
    it back, under a comment block (`header` lines, what changed, and how to deploy it behind
    vLLM in the `scheduling` policy the simulation ran)."""
    base = space.base
    data = space.apply(row.config)
    settings = load_settings(data=data)  # raises if the search produced an invalid config
    Runtime(settings.to_runtime())  # and so does the core, which checks more (tier order)
    dumped = settings.model_dump(mode="json", exclude={"backends"})
    changed = [
        f"#   {p}: {_fmt(v)} (was {_fmt(get_path(base, p))})"
        for p, v in row.config.items()
        if v != get_path(base, p)
    ]
    text = [
        "# llmflow config tuned by `llmflow sim tune`.",
        *(f"# {h}" for h in header),
        f"# Chosen: trial {row.number}: "
        + ", ".join(
            f"{o.name} {_fmt(v)}"
            for o, v in zip(goals.objectives, row.objectives or [], strict=True)
        ),
        "# Changed from the starting config:"
        if changed
        else "# Nothing changed: the starting config was the best trial.",
        *changed,
        "#",
        "# Deploy: add a `backends:` section (url, gpus, models, max_model_len and",
        f"# scheduling_policy: {scheduling}, the vLLM scheduling the simulation ran) and the",
        "# tenants' api_keys, then `llmflow serve --config tuned.yaml`. Without `backends:`",
        "# it serves the built-in simulated vLLM.",
        yaml.safe_dump(dumped, sort_keys=False, default_flow_style=None, width=100),
    ]
    path = out / "tuned.yaml"
    path.write_text("\n".join(text), encoding="utf-8")
    return path


def render_holdout(
    results: dict[str, dict[str, list[float]]], goals: Goals, extra: list[Any], intro: str
) -> str:
    """`holdout.md`: each metric's mean and worst seed for the starting and the tuned config,
    and whether every constraint held on every held-out seed."""
    metrics = list({m.name: m for m in (*goals.metrics, *extra)}.values())
    head = [
        "metric",
        "goal",
        "defaults mean",
        "defaults worst",
        "tuned mean",
        "tuned worst",
        "change (mean)",
    ]
    goal = {o.name: o.direction for o in goals.objectives}
    for c in goals.constraints:
        goal.setdefault(c.metric.name, c.text)
    lines = [intro, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    d, t = results["defaults"], results["tuned"]
    for m in metrics:
        dm, tm = fmean(d[m.name]), fmean(t[m.name])
        change = f"{(tm - dm) / abs(dm):+.1%}" if dm else "-"
        lines.append(
            f"| {m.name} | {goal.get(m.name, '')} | {_fmt(dm)} | "
            f"{_fmt(m.worst(d[m.name]))} | {_fmt(tm)} | {_fmt(m.worst(t[m.name]))} | "
            f"{change} |"
        )
    lines.append("")
    for c in goals.constraints:
        held = {label: c.violation(results[label][c.metric.name]) <= 0 for label in results}
        lines.append(
            f"- `{c.text}` on every held-out seed: defaults "
            f"{'met' if held['defaults'] else 'MISSED'}, tuned "
            f"{'met' if held['tuned'] else 'MISSED'}"
        )
    return "\n".join(lines) + "\n"
