"""`llmflow sim tune`: search a gated policy's knobs for the config that best meets an objective
under constraints, and write it as a config `llmflow serve --config` loads.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmflow.sim.tuning.plan import HOLDOUT_OFFSET, STUDY, TIMEOUT_S, TRIALS, TuneOptions

if TYPE_CHECKING:
    import argparse

__all__ = ["add_tune"]

_EPILOG = """\
metrics (times in seconds, from each run's report):
  goodput         requests completed within their class SLO per simulated second (maximize)
  makespan        simulated seconds until the last request ended (minimize)
  lost            rejected + timed_out + truncated + failed + unfinished, all classes (minimize)
  completed_frac, preemptions, peak_kv, peak_queue
  <class>.ttft_p50|ttft_p90|ttft_p99|e2e_p50|e2e_p90|e2e_p99|wait_p50|wait_p99 (minimize)
  <class>.completed_frac|completed (maximize), <class>.lost|rejected|timed_out|truncated|
  failed|unfinished|cancelled|retries_429 (minimize)
An objective is the mean over the search seeds; a constraint must hold on the worst seed.

knobs searched (a config path and its range; tiers[*] = each tier the workload uses):
{knobs}

example:
  llmflow sim tune marketing-flood --objective goodput --constraint 'business.ttft_p99<=1.5'
"""


def add_tune(sim_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `tune` under `llmflow sim`."""
    import argparse

    from llmflow.sim.tuning.space import KNOBS

    def _range(k: Any) -> str:
        d = k.dist
        return f"{d.low}..{d.high}{' log' if d.log else ''}{' or off' if k.can_be_off else ''}"

    knobs = "\n".join(f"  {k.path:<30} {_range(k):<22} {k.what}" for k in KNOBS)
    p = sim_sub.add_parser(
        "tune",
        help="search a policy's knobs for the best config (optuna)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Search the knobs of a scenario's gated policy (its cap, shares, shedding, "
        "SLA, breaker and queue length) with optuna's TPE sampler in parallel processes, each "
        "trial simulated on several seeds. Writes to --out: tuned.yaml (a config `llmflow serve "
        "--config` loads as is; add your backends), pareto.png, trials.csv, trials.md, "
        "holdout.md (tuned vs the policy's starting config on held-out seeds) and "
        "study.journal (the optuna study, replaced on each run; or the study named --study "
        "in --storage, which workers on other machines join with --worker-only). The "
        "scenario's declared SLOs are constraints too unless --ignore-slo.",
        epilog=_EPILOG.format(knobs=knobs),
    )
    p.add_argument(
        "scenario",
        nargs="?",
        metavar="SCENARIO",
        help="scenario YAML file or name (not with --worker-only: the study carries it)",
    )
    p.add_argument(
        "--objective",
        action="append",
        metavar="METRIC",
        help="metric to optimise, in its natural direction (repeat for a "
        "multi-objective study; the first picks tuned.yaml; default: goodput)",
    )
    p.add_argument(
        "--constraint",
        action="append",
        default=[],
        metavar="'METRIC<=X'",
        help="METRIC<=X or METRIC>=X, on the worst seed (repeatable)",
    )
    p.add_argument(
        "--ignore-slo",
        action="store_true",
        help="do not add the scenario's declared SLOs as constraints",
    )
    p.add_argument(
        "--knob",
        action="append",
        metavar="PATH",
        help="search only this knob (repeatable; a path from the list below, or a "
        "concrete one such as tiers[batch].max_share); default: all",
    )
    p.add_argument(
        "--policy",
        default="llmflow",
        metavar="NAME",
        help="the scenario's gated policy whose config is the starting point (default llmflow)",
    )
    p.add_argument(
        "--trials",
        type=int,
        default=TRIALS,
        metavar="N",
        help=f"trials in the study, the starting config first (default {TRIALS})",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        metavar="J",
        help="worker processes (default: the CPU count)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=3,
        metavar="K",
        help="seeds per trial: the scenario's seed + 0..K-1 (default 3)",
    )
    p.add_argument(
        "--holdout-seeds",
        type=int,
        default=3,
        metavar="H",
        help=f"held-out seeds (the scenario's seed + {HOLDOUT_OFFSET} + 0..H-1) on "
        "which tuned and starting configs are compared (default 3; 0 skips)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=TIMEOUT_S,
        metavar="S",
        help=f"start no trial after S seconds (default {TIMEOUT_S:g}; 0: no limit)",
    )
    p.add_argument(
        "--sampler-seed",
        type=int,
        default=0,
        metavar="N",
        help="seed of the samplers (worker k uses N + k)",
    )
    p.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="output folder (default: sim-out/<scenario name>-tune)",
    )
    p.add_argument(
        "--storage",
        metavar="URL",
        help="keep the study where workers on other machines reach it: sqlite:///PATH, "
        "postgresql://USER:PASS@HOST/DB, mysql+pymysql://..., or redis://HOST:PORT/DB "
        "(default: DIR/study.journal, this machine only)",
    )
    p.add_argument(
        "--study",
        default=STUDY,
        metavar="NAME",
        help=f"the study's name in --storage (default {STUDY}; a new run needs a new name)",
    )
    p.add_argument(
        "--worker-only",
        action="store_true",
        help="join the study NAME in --storage that `llmflow sim tune SCENARIO --storage URL "
        "--study NAME` created (elsewhere), run --jobs workers on its trials, and exit when "
        "it holds them all; the study carries the scenario and every search setting",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=600.0,
        metavar="S",
        help="--worker-only: wait up to S seconds for the study to be created (default 600)",
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.set_defaults(func=_tune)


def _options(args: argparse.Namespace) -> TuneOptions:
    return TuneOptions(
        scenario=args.scenario,
        objectives=tuple(args.objective or ()),
        constraints=tuple(args.constraint),
        ignore_slo=args.ignore_slo,
        knobs=tuple(args.knob or ()),
        policy=args.policy,
        trials=args.trials,
        jobs=args.jobs,
        seeds=args.seeds,
        holdout_seeds=args.holdout_seeds,
        timeout_s=args.timeout,
        sampler_seed=args.sampler_seed,
        out=args.out,
        storage=args.storage,
        study=args.study,
        worker_only=args.worker_only,
        wait_s=args.wait,
        progress=not args.no_progress,
    )


def _tune(args: argparse.Namespace) -> int:
    return run_command(_options(args))


def run_command(options: TuneOptions) -> int:
    """`llmflow sim tune` with these options: check them, plan the run and run it (or, with
    `worker_only`, join a study created elsewhere).

    Returns:
        The exit status: 2 for options, a scenario or goals it cannot use (said on stderr),
        else `tune`'s (or 0 for a worker).
    """
    from llmflow.config import ConfigFileError
    from llmflow.sim.scenario import ScenarioError, find_scenario, load_scenario
    from llmflow.sim.tuning.goals import GoalError, slo_constraints
    from llmflow.sim.tuning.plan import Goals, Plan
    from llmflow.sim.tuning.space import Space, base_config

    problem = options.problem()
    if options.worker_only and not problem:
        return _work_only(options)
    objectives = list(options.objectives or ["goodput"])
    try:
        if problem:
            raise ValueError(problem)
        path = find_scenario(str(options.scenario))
        sc = load_scenario(path)
        constraints = [*([] if options.ignore_slo else slo_constraints(sc)), *options.constraints]
        goals = Goals(sc, objectives, list(dict.fromkeys(constraints)))
        space = Space(base_config(sc, options.policy), list(options.knobs) or None)
    except (
        FileNotFoundError,
        ScenarioError,
        ConfigFileError,
        GoalError,
        KeyError,
        ValueError,
    ) as exc:
        print(f"error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    out = options.out or Path("sim-out") / f"{path.stem}-tune"
    out.mkdir(parents=True, exist_ok=True)
    storage = options.storage or str((out / "study.journal").resolve())
    taken = _taken(storage, options.study)
    if taken:
        print(f"error: {taken}", file=sys.stderr)
        return 2
    plan = Plan(
        path.resolve(),
        options.policy,
        tuple(objectives),
        tuple(c.text for c in goals.constraints),
        options.knobs or None,
        tuple(sc.seed + k for k in range(options.seeds)),
        options.trials,
        time.time() + (options.timeout_s or float("inf")),
        storage,
        options.study,
        options.sampler_seed,
    )
    from llmflow.sim.tuning.run import tune

    return tune(plan, sc, goals, space, out, options)


def _taken(storage: str, study: str) -> str | None:
    """Why a new study cannot be created there (a shared store keeps old studies)."""
    from llmflow.sim.tuning.storage import has_study, is_url, open_storage

    if not is_url(storage):
        return None  # the output folder's journal is replaced
    try:
        exists = has_study(open_storage(storage), study)
    except Exception as exc:  # the store's client raises its own kinds
        return f"--storage {storage}: cannot open it ({type(exc).__name__}: {exc})"
    if exists:
        return (
            f"study {study!r} already exists in {storage}: pick a new --study NAME "
            f"(or remove it: optuna delete-study --storage {storage} --study-name {study})"
        )
    return None


def _work_only(options: TuneOptions) -> int:
    """`--worker-only`: join a study created elsewhere and run trials until it is full."""
    from llmflow.sim.tuning.storage import StudyMissing, plan_from_study, wait_study
    from llmflow.sim.tuning.workers import join

    storage = str(options.storage)
    try:
        study = wait_study(storage, options.study, options.wait_s)
    except (StudyMissing, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    plan = plan_from_study(study, storage)
    ran: list[int] = []
    print(
        f"joined study {options.study} in {storage}: {plan.scenario.name}, policy "
        f"{plan.policy}, {plan.trials} trials; {options.jobs} workers here",
        file=sys.stderr,
    )
    join(plan, options.jobs, lambda number, _values, _ok: ran.append(number))
    print(f"ran trials {sorted(ran)} here", file=sys.stderr)
    return 0
