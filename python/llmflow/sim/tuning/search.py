"""Running the search: the study, the objectives' evaluation by simulation, and the held-out
check.

The study lives in a journal file in the output folder (`study.journal`), or, given
`--storage URL`, in an RDB or Redis that workers on several machines share (`storage.py`;
`llmflow sim tune --worker-only` joins from another machine). Worker processes
(`workers.py`) ask it for trials; each trial's config is simulated on each search seed, and
the study told the objectives' means and the constraints' worst seeds. The first trial is the
starting config itself, so the tuned config is never worse than it on the search seeds.
"""

from __future__ import annotations

import math
import multiprocessing
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna

from llmflow.sim.runner import run_policy
from llmflow.sim.scenario import load_scenario
from llmflow.sim.tuning.goals import parse_constraint, parse_metric
from llmflow.sim.workload import build_requests

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from llmflow.sim.scenario import Scenario
    from llmflow.sim.tuning.goals import Constraint, Metric
    from llmflow.sim.tuning.space import Space
    from llmflow.sim.workload import Requests

__all__ = ["Goals", "Plan", "evaluate", "holdout", "search"]


@dataclass(frozen=True)
class Plan:
    """One tuning run, as its workers need it (plain values: workers are spawned)."""

    scenario: Path
    policy: str
    objectives: tuple[str, ...]
    constraints: tuple[str, ...]
    knobs: tuple[str, ...] | None  # None: the whole table
    seeds: tuple[int, ...]
    trials: int
    deadline: float  # wall clock (time.time()) after which no trial starts
    storage: str  # a journal file path, or an RDB / redis:// URL (storage.py)
    study: str  # the study's name in the storage
    sampler_seed: int


class Goals:
    """A plan's objectives and constraints, parsed against its scenario.

    Raises:
        GoalError: an unknown metric or a malformed constraint.
    """

    def __init__(self, sc: Scenario, objectives: Sequence[str], constraints: Sequence[str]):
        self.objectives: list[Metric] = [parse_metric(o, sc) for o in objectives]
        self.constraints: list[Constraint] = [parse_constraint(c, sc) for c in constraints]

    @property
    def metrics(self) -> list[Metric]:
        """Every metric a trial must measure, once each."""
        seen: dict[str, Metric] = {}
        for m in (*self.objectives, *(c.metric for c in self.constraints)):
            seen.setdefault(m.name, m)
        return list(seen.values())


def evaluate(
    sc: Scenario,
    policy: str,
    config: dict[str, Any] | None,
    seeds: Sequence[int],
    metrics: Sequence[Metric],
    cache: dict[int, Requests] | None = None,
    stop: Callable[[dict[str, list[float]]], bool] | None = None,
) -> dict[str, list[float]]:
    """Simulate one config on each seed and read the metrics.

    Args:
        sc: the scenario.
        policy: the scenario's gated policy whose config is replaced.
        config: the full config to run; None runs the policy as the scenario defines it.
        seeds: one run per seed (its requests and its clients' jitter).
        metrics: what to read from each run.
        cache: requests already built, by seed (filled as it goes).
        stop: called with the values so far after each seed; True skips the remaining seeds.

    Returns:
        Each metric's values, one per seed run, in seed order.

    Raises:
        ConfigFileError: the config does not validate.
        ConfigError: the core refuses it.
    """
    spec = sc.policies[policy]
    if config is not None:
        spec = spec.model_copy(update={"config": config})
    cache = {} if cache is None else cache
    out: dict[str, list[float]] = {m.name: [] for m in metrics}
    for seed in seeds:
        if seed not in cache:
            cache[seed] = build_requests(sc, seed)
        run = run_policy(sc, policy, spec, cache[seed], seed)
        for m in metrics:
            out[m.name].append(m.read(run.summary))
        if stop is not None and stop(out):
            break
    return out


def search(
    plan: Plan,
    space: Space,
    goals: Goals,
    jobs: int,
    on_trial: Callable[[int, list[float] | None, bool], None] | None = None,
) -> optuna.Study:
    """Create the study, queue the starting config, run `jobs` worker processes on it, and wait
    for the trials that workers on other machines (`join`) took.

    Args:
        plan: the run.
        space: its search space (for the starting config's parameters).
        goals: its objectives (for the study's directions).
        jobs: worker processes on this machine (0: only workers elsewhere run trials).
        on_trial: called in this process as each trial ends, wherever it ran (number,
            objectives or None when the trial failed, feasible).

    Returns:
        The study, reloaded from its storage.

    Raises:
        RuntimeError: a worker failed (with its traceback).
    """
    from llmflow.sim.tuning.storage import is_url, open_storage, store_plan
    from llmflow.sim.tuning.workers import Once, await_elsewhere, quiet, run_workers

    quiet()
    if not is_url(plan.storage):
        Path(plan.storage).unlink(missing_ok=True)  # the output folder's journal: a new run
    study = optuna.create_study(
        study_name=plan.study,
        storage=open_storage(plan.storage),
        directions=[optuna.study.StudyDirection[o.direction.upper()] for o in goals.objectives],
    )
    study.set_user_attr("seeds", list(plan.seeds))
    study.enqueue_trial(space.defaults(), user_attrs={"label": "defaults"})
    store_plan(study, plan)
    once = Once(on_trial)
    run_workers(plan, jobs, 0, once)
    await_elsewhere(study, plan, once)
    return optuna.load_study(study_name=plan.study, storage=open_storage(plan.storage))


def _holdout_run(
    scenario: Path, policy: str, config: dict[str, Any] | None, seed: int, names: list[str]
) -> list[float]:
    sc = load_scenario(scenario)
    metrics = [parse_metric(n, sc) for n in names]
    out = evaluate(sc, policy, config, [seed], metrics)
    return [out[n][0] for n in names]


def holdout(
    scenario: Path,
    policy: str,
    configs: dict[str, dict[str, Any] | None],
    seeds: Sequence[int],
    names: list[str],
    jobs: int,
    progress: bool = False,
) -> dict[str, dict[str, list[float]]]:
    """Simulate each labelled config on each held-out seed, in `jobs` processes.

    Args:
        scenario: the scenario file.
        policy: the gated policy whose config is replaced.
        configs: label -> full config (None: the policy as the scenario defines it).
        seeds: the held-out seeds.
        names: the metrics to read.
        jobs: worker processes.
        progress: show a progress bar.

    Returns:
        label -> metric -> one value per seed, in seed order.
    """
    from tqdm import tqdm

    ctx = multiprocessing.get_context("spawn")
    runs = [(label, seed) for label in configs for seed in seeds]
    out: dict[str, dict[str, list[float]]] = {
        label: {n: [math.nan] * len(seeds) for n in names} for label in configs
    }
    with (
        ProcessPoolExecutor(max_workers=max(1, min(jobs, len(runs))), mp_context=ctx) as pool,
        tqdm(
            total=len(runs), desc="held-out", unit="run", disable=not progress, dynamic_ncols=True
        ) as bar,
    ):
        futures = {
            pool.submit(_holdout_run, scenario, policy, configs[label], seed, names): (label, i)
            for label in configs
            for i, seed in enumerate(seeds)
        }
        for fut in as_completed(futures):
            label, i = futures[fut]
            for n, v in zip(names, fut.result(), strict=True):
                out[label][n][i] = v
            bar.update(1)
    return out
