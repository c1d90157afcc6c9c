"""`pareto.png`: the trials of a tuning run on two metrics at a time, with the front.

Two objectives are drawn against each other (each pair, up to three panels); one objective is
drawn against each constrained metric, with the bound and the front of the trials that meet the
other constraints (what relaxing that bound alone would buy); a lone objective against the trial
number. The starting config and the tuned one are marked.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    from llmflow.sim.tuning.outputs import Row
    from llmflow.sim.tuning.plan import Goals

__all__ = ["write_pareto"]


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
