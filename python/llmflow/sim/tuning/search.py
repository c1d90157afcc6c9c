"""Running the search: the study, its workers, and the held-out check.

The study lives in a journal file in the output folder (`study.journal`), or, given
`--storage URL`, in an RDB or Redis that workers on several machines share (`storage.py`;
`llmflow sim tune --worker-only` joins from another machine). Worker processes
(`workers.py`) ask it for trials; each trial's config is simulated on each search seed
(`plan.evaluate`), and
the study told the objectives' means and the constraints' worst seeds. The first trial is the
starting config itself, so the tuned config is never worse than it on the search seeds.
"""

from __future__ import annotations

import math
import multiprocessing
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna

from llmflow.sim.scenario import load_scenario
from llmflow.sim.tuning.goals import parse_metric
from llmflow.sim.tuning.plan import evaluate
from llmflow.sim.tuning.storage import is_url, open_storage, store_plan
from llmflow.sim.tuning.workers import Once, await_elsewhere, quiet, run_workers

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from llmflow.sim.tuning.plan import Goals, Plan
    from llmflow.sim.tuning.space import Space

__all__ = ["holdout", "search"]


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
