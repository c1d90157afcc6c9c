"""One `llmflow sim tune` run from its options: search, tables, plot, tuned.yaml, held-out
comparison, and the summary printed at the end."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

from llmflow.sim.policies import PRESETS
from llmflow.sim.tuning.goals import parse_metric
from llmflow.sim.tuning.outputs import (
    choose,
    render_holdout,
    rows_of,
    write_tables,
    write_tuned,
)
from llmflow.sim.tuning.pareto import write_pareto
from llmflow.sim.tuning.plan import HOLDOUT_OFFSET
from llmflow.sim.tuning.search import holdout, search
from llmflow.sim.tuning.space import get_path

if TYPE_CHECKING:
    from pathlib import Path

    from llmflow.sim.scenario import Scenario
    from llmflow.sim.tuning.outputs import Row
    from llmflow.sim.tuning.plan import Goals, Plan, TuneOptions
    from llmflow.sim.tuning.space import Space

__all__ = ["tune"]


def _bar(plan: Plan, goals: Goals, show: bool) -> tuple[Any, Any]:
    from tqdm import tqdm

    bar = tqdm(total=plan.trials, desc="trials", unit="trial", disable=not show, dynamic_ncols=True)
    first = goals.objectives[0]
    best: list[float] = []
    feasible = [0]

    def on_trial(_number: int, values: list[float] | None, ok: bool) -> None:
        bar.update(1)
        if values is None or not ok:
            return
        feasible[0] += 1
        v = values[0]
        if not best or (v < best[0] if first.direction == "minimize" else v > best[0]):
            best[:] = [v]
        bar.set_postfix_str(f"feasible {feasible[0]}, best {first.name} {best[0]:.4g}")

    return bar, on_trial


def _intro(plan: Plan, sc: Scenario, goals: Goals, n: int, command: str) -> str:
    seeds = ", ".join(map(str, plan.seeds))
    objs = "; ".join(f"{o.direction} {o.name} ({o.what})" for o in goals.objectives)
    cons = ", ".join(f"`{c.text}`" for c in goals.constraints) or "none"
    return (
        f"# Tuning {sc.title}: policy {plan.policy}\n\n"
        f"`{command}`\n\n{n} trials, each simulated on seeds {seeds}. Objectives (mean "
        f"over the seeds): {objs}. Constraints (worst seed): {cons}. Trial 0 is the "
        "starting config. Knob values are what the trial ran; `off` is null."
    )


def tune(
    plan: Plan, sc: Scenario, goals: Goals, space: Space, out: Path, options: TuneOptions
) -> int:
    """Run the search and write every output.

    Args:
        plan: the run, as its workers see it.
        sc: the plan's scenario.
        goals: the plan's objectives and constraints, parsed.
        space: the knobs searched, around the policy's starting config.
        out: the output folder (it exists).
        options: what the command was asked (jobs, held-out seeds, progress, the command line
            recorded in the outputs).

    Returns:
        The exit status: 0, 1 when no trial met every constraint, 130 when interrupted.
    """
    t0 = time.perf_counter()
    jobs = min(options.jobs, plan.trials)
    print(
        f"tuning {len(space.paths)} knobs of {plan.policy} on {sc.title}: {plan.trials} "
        f"trials x {len(plan.seeds)} seeds in {jobs} processes"
        + (
            f"; study {plan.study} in {plan.storage} (join from other machines with "
            f"`llmflow sim tune --worker-only --storage {plan.storage} --study {plan.study}`)"
            if options.storage
            else ""
        ),
        file=sys.stderr,
    )
    bar, on_trial = _bar(plan, goals, options.progress)
    try:
        study = search(plan, space, goals, jobs, on_trial)
    except KeyboardInterrupt:
        print(f"\ninterrupted; the trials so far are in {plan.storage}", file=sys.stderr)
        return 130
    finally:
        bar.close()
    rows = rows_of(study, goals)
    chosen = choose(rows, goals)
    search_s = time.perf_counter() - t0
    written = write_tables(rows, goals, out, _intro(plan, sc, goals, len(rows), options.command()))
    written.append(
        write_pareto(
            rows, goals, chosen, out, f"{sc.title}\npolicy {plan.policy}, {len(rows)} trials"
        )
    )
    if chosen is None:
        print(
            f"\nno trial met every constraint ({', '.join(c.text for c in goals.constraints)})"
            "; no tuned.yaml written. Relax a constraint, add --trials, or see trials.md.",
            file=sys.stderr,
        )
        _report(written, search_s, time.perf_counter() - t0)
        return 1
    header = [
        f"Scenario: {sc.title} ({plan.scenario.name}), policy {plan.policy}.",
        f"Command: {options.command()}",
        f"Objectives (mean over seeds {', '.join(map(str, plan.seeds))}): "
        + ", ".join(f"{o.direction} {o.name}" for o in goals.objectives)
        + "; constraints "
        "(worst seed): " + (", ".join(c.text for c in goals.constraints) or "none") + ".",
    ]
    spec = sc.policies[plan.policy]
    scheduling = spec.scheduling_policy or PRESETS[spec.preset_for(plan.policy)][1]
    written.insert(0, write_tuned(space, chosen, goals, out, header, scheduling))
    print(_summary(chosen, rows, goals, space), end="")
    if options.holdout_seeds:
        text = _holdout(plan, sc, goals, space, chosen, options)
        (out / "holdout.md").write_text(text, encoding="utf-8")
        written.append(out / "holdout.md")
        print("\n" + text, end="")
    _report(written, search_s, time.perf_counter() - t0)
    return 0


def _summary(chosen: Row, rows: list[Row], goals: Goals, space: Space) -> str:
    ok = sum(r.feasible for r in rows)
    lines = [
        f"{len(rows)} trials, {ok} feasible; tuned = trial {chosen.number}: "
        + ", ".join(
            f"{o.name} {v:.4g}"
            for o, v in zip(goals.objectives, chosen.objectives or [], strict=True)
        )
    ]
    start = next((r for r in rows if r.label == "defaults" and r.objectives), None)
    if start is not None:
        lines[0] += (
            " (starting config: "
            + ", ".join(
                f"{o.name} {v:.4g}"
                for o, v in zip(goals.objectives, start.objectives or [], strict=True)
            )
            + ("" if start.feasible else ", infeasible")
            + ")"
        )
    for p, v in chosen.config.items():
        was = get_path(space.base, p)
        if v != was:
            lines.append(f"  {p}: {_show(v)} (was {_show(was)})")
    return "\n".join(lines) + "\n"


def _show(v: Any) -> str:
    return "off" if v is None else str(v)


def _holdout(
    plan: Plan, sc: Scenario, goals: Goals, space: Space, chosen: Row, options: TuneOptions
) -> str:
    seeds = [sc.seed + HOLDOUT_OFFSET + k for k in range(options.holdout_seeds)]
    extra = [parse_metric(n, sc) for n in ("goodput", "makespan", "lost")]
    extra += [
        parse_metric(f"{wc.name}.{k}", sc)
        for wc in sc.workload
        for k in ("ttft_p99", "completed_frac")
    ]
    names = list(dict.fromkeys(m.name for m in (*goals.metrics, *extra)))
    configs = {"defaults": None, "tuned": space.apply(chosen.config)}
    results = holdout(
        plan.scenario, plan.policy, configs, seeds, names, options.jobs, progress=options.progress
    )
    intro = (
        f"# Held-out seeds: tuned (trial {chosen.number}) vs the starting config\n\n"
        f"{sc.title}, policy {plan.policy}, seeds {', '.join(map(str, seeds))} (the search "
        f"used {', '.join(map(str, plan.seeds))}). `defaults` is the policy as the scenario "
        "defines it. Mean and worst over the held-out seeds."
    )
    return render_holdout(results, goals, extra, intro)


def _report(written: list[Path], search_s: float, total_s: float) -> None:
    print(
        f"\nsearch {search_s:.0f} s, total {total_s:.0f} s wall; wrote "
        + ", ".join(str(p) for p in written),
        file=sys.stderr,
    )
