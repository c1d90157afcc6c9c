"""What `llmflow sim tune` leaves in its output folder, from the finished study.

`trials.csv` and `trials.md` (one row per trial: the config values it ran, objectives, the
constraints' worst seeds, feasible, on the Pareto front), `tuned.yaml` (the chosen trial's full
config, which `llmflow serve --config` loads unchanged), `pareto.png`, and `holdout.md` (tuned
against the starting config on held-out seeds). The chosen trial is the feasible one best on the
first objective (ties broken by the next ones); the others on the front are in the tables.
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

if TYPE_CHECKING:
    from pathlib import Path

    import optuna

    from llmflow.sim.tuning.search import Goals

__all__ = [
    "Row",
    "choose",
    "render_holdout",
    "rows_of",
    "write_pareto",
    "write_tables",
    "write_tuned",
]


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
    """The feasible trial best on the first objective (then the next ones); None if no trial
    met every constraint."""
    signs = [1.0 if o.direction == "minimize" else -1.0 for o in goals.objectives]
    ok = [r for r in rows if r.feasible and r.objectives is not None]
    if not ok:
        return None
    return min(
        ok,
        key=lambda r: ([s * v for s, v in zip(signs, r.objectives or [], strict=True)], r.number),
    )


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


def tuned_config(base: dict[str, Any], row: Row) -> dict[str, Any]:
    """The chosen trial's full config: the starting one with the trial's values."""
    from llmflow.sim.tuning.space import set_path

    data: dict[str, Any] = yaml.safe_load(yaml.safe_dump(base))  # a deep copy of plain data
    for path, value in row.config.items():
        set_path(data, path, value)
    return data


def write_tuned(
    base: dict[str, Any], row: Row, goals: Goals, out: Path, header: list[str], scheduling: str
) -> Path:
    """`tuned.yaml`: a full llmflow config (every section but `backends`), checked by loading
    it back, under a comment block (`header` lines, what changed, and how to deploy it behind
    vLLM in the `scheduling` policy the simulation ran)."""
    from llmflow.sim.tuning.space import get_path

    data = tuned_config(base, row)
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


def write_pareto(rows: list[Row], goals: Goals, chosen: Row | None, out: Path, title: str) -> Path:
    """`pareto.png`: the trials on two metrics (two objectives, or the objective against each
    constrained metric), the non-dominated front, the starting config and the chosen one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r.objectives is not None]
    panels = _panels(goals)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.0 * len(panels), 4.8), squeeze=False)
    for ax, (x, y, bound) in zip(axes[0], panels, strict=True):
        _panel(ax, done, goals, chosen, x, y, bound)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path = out / "pareto.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


_Axis = tuple[str, int, Any]  # ("objective"|"constraint"|"trial", index, metric)


def _panels(goals: Goals) -> list[tuple[_Axis, _Axis, float | None]]:
    objs: list[_Axis] = [("objective", i, o) for i, o in enumerate(goals.objectives)]
    if len(objs) >= 2:
        pairs = [(objs[i], objs[j]) for i in range(len(objs)) for j in range(i + 1, len(objs))]
        return [(a, b, None) for a, b in pairs[:3]]
    if goals.constraints:
        return [
            (("constraint", i, c.metric), objs[0], c.bound)
            for i, c in enumerate(goals.constraints[:3])
        ]
    return [(("trial", 0, None), objs[0], None)]


def _value(r: Row, axis: _Axis) -> float:
    kind, i, _ = axis
    if kind == "trial":
        return float(r.number)
    src = r.objectives if kind == "objective" else r.constraints
    return float(src[i]) if src else math.nan


def _label(axis: _Axis, goals: Goals) -> str:
    kind, _, m = axis
    if kind == "trial":
        return "trial"
    how = "mean over seeds" if kind == "objective" else "worst seed"
    unit = f", {m.unit}" if m.unit else ""
    return f"{m.name} ({how}{unit})"


def _panel(
    ax: Any,
    rows: list[Row],
    goals: Goals,
    chosen: Row | None,
    x: _Axis,
    y: _Axis,
    bound: float | None,
) -> None:
    ok = [r for r in rows if r.feasible]
    bad = [r for r in rows if not r.feasible]
    ax.scatter(
        [_value(r, x) for r in bad],
        [_value(r, y) for r in bad],
        marker="x",
        color="0.6",
        label=f"infeasible ({len(bad)})",
    )
    ax.scatter(
        [_value(r, x) for r in ok],
        [_value(r, y) for r in ok],
        color="tab:blue",
        s=18,
        label=f"feasible ({len(ok)})",
    )
    if x[0] == "constraint":  # what relaxing this bound alone would buy
        pool = [
            r
            for r in rows
            if all(
                _met(c, v)
                for j, (c, v) in enumerate(zip(goals.constraints, r.constraints, strict=True))
                if j != x[1]
            )
        ]
        what = "front (other constraints met)"
    else:
        pool, what = ok, "Pareto front (feasible)"
    front = _front(pool, x, y)
    if front:
        ax.plot(
            [_value(r, x) for r in front],
            [_value(r, y) for r in front],
            color="tab:red",
            lw=1.2,
            marker="o",
            ms=3,
            label=what,
        )
    for r in rows:
        if r.label == "defaults":
            ax.scatter(
                [_value(r, x)],
                [_value(r, y)],
                marker="*",
                s=180,
                color="black",
                label="starting config",
                zorder=5,
            )
    if chosen is not None:
        ax.scatter(
            [_value(chosen, x)],
            [_value(chosen, y)],
            s=160,
            facecolors="none",
            edgecolors="tab:green",
            linewidths=2.5,
            label=f"tuned (trial {chosen.number})",
            zorder=6,
        )
    if bound is not None:
        ax.axvline(bound, color="tab:orange", ls="--", lw=1, label=f"bound {bound:g}")
    for axis, setter in ((x, ax.set_xlabel), (y, ax.set_ylabel)):
        setter(_label(axis, goals))
        if axis[0] != "trial" and axis[2].unit == "s" and _spread(rows, axis) > 100:
            (ax.set_xscale if axis is x else ax.set_yscale)("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _met(c: Any, worst: float) -> bool:
    return bool(worst <= c.bound if c.op == "<=" else worst >= c.bound)


def _spread(rows: list[Row], axis: _Axis) -> float:
    vals = [_value(r, axis) for r in rows if _value(r, axis) > 0]
    return max(vals) / min(vals) if vals else 1.0


def _front(rows: list[Row], x: _Axis, y: _Axis) -> list[Row]:
    """Non-dominated trials on the two axes (each in its metric's direction), sorted by x."""
    if x[0] == "trial":
        return []
    sx = 1.0 if x[2].direction == "minimize" else -1.0
    sy = 1.0 if y[2].direction == "minimize" else -1.0
    pts = [(sx * _value(r, x), sy * _value(r, y), r) for r in rows]
    pts = [p for p in pts if not (math.isnan(p[0]) or math.isnan(p[1]))]
    front = [
        p for p in pts if not any(q[0] <= p[0] and q[1] <= p[1] and q[:2] != p[:2] for q in pts)
    ]
    return [p[2] for p in sorted(front, key=lambda p: _value(p[2], x))]
