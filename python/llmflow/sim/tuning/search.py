"""Running the search: worker processes sharing one optuna study, and the held-out check.

The study lives in a journal file in the output folder (`study.journal`, optuna's
`JournalFileBackend`), so workers on one machine share it through file locks today and workers
on several machines could share it later. Each worker is a spawned process with its own TPE
sampler (multivariate, with a constant liar so parallel workers do not propose the same point;
it reads the constraints each trial sets). A worker asks for a trial, simulates the trial's
config on each search seed and tells the study the objectives' means and the constraints'
worst seeds; a trial that breaks a constraint on one seed stops there, since more seeds cannot
mend a worst case. A lock taken around "count, then ask" makes the study hold exactly
`--trials` trials. The first trial is the starting config itself, so the tuned config is never
worse than it on the search seeds.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import queue
import time
import traceback
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from statistics import fmean
from typing import TYPE_CHECKING, Any

import optuna

from llmflow._core import ConfigError
from llmflow.config import ConfigFileError
from llmflow.sim.runner import run_policy
from llmflow.sim.scenario import load_scenario
from llmflow.sim.tuning.goals import parse_constraint, parse_metric
from llmflow.sim.tuning.space import Space, base_config
from llmflow.sim.workload import build_requests

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from multiprocessing.queues import Queue
    from multiprocessing.synchronize import Lock
    from pathlib import Path

    from llmflow.sim.scenario import Scenario
    from llmflow.sim.tuning.goals import Constraint, Metric
    from llmflow.sim.workload import Requests

__all__ = ["STUDY", "Goals", "Plan", "evaluate", "holdout", "open_storage", "search"]

STUDY = "llmflow-tune"  # the study's name in the journal
_STARTUP = 10  # random trials before TPE models the results (fewer on short runs)


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
    journal: Path
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


def open_storage(journal: Path) -> optuna.storages.JournalStorage:
    """The study's storage: optuna's journal in a file (shared through file locks)."""
    from optuna.storages.journal import JournalFileBackend

    return optuna.storages.JournalStorage(JournalFileBackend(str(journal)))


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


def _quiet() -> None:
    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
    optuna.logging.set_verbosity(optuna.logging.WARNING)


class _Worker:
    def __init__(self, plan: Plan, index: int):
        _quiet()
        self.plan = plan
        self.sc = load_scenario(plan.scenario)
        self.goals = Goals(self.sc, plan.objectives, plan.constraints)
        self.space = Space(base_config(self.sc, plan.policy), list(plan.knobs or ()) or None)
        sampler = optuna.samplers.TPESampler(
            seed=plan.sampler_seed + index,
            multivariate=True,
            group=True,
            constant_liar=True,
            n_startup_trials=min(_STARTUP, max(plan.trials // 4, 2)),
        )
        self.study = optuna.load_study(
            study_name=STUDY, storage=open_storage(plan.journal), sampler=sampler
        )
        self.cache: dict[int, Requests] = {}
        self.parent = os.getppid()

    def run(self, lock: Lock, events: Queue[tuple[Any, ...]]) -> None:
        while time.time() < self.plan.deadline and os.getppid() == self.parent:
            with lock:
                if len(self.study.get_trials(deepcopy=False)) >= self.plan.trials:
                    return
                trial = self.study.ask()
            try:
                values = self._measure(trial)
            except (ConfigFileError, ConfigError) as exc:  # a knob range the validators refuse
                trial.set_user_attr("error", str(exc).splitlines()[-1])
                self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
                events.put(("trial", trial.number, None, False))
                continue
            frozen = self.study.tell(trial, values)
            feasible = all(v <= 0 for v in frozen.constraints.values())
            events.put(("trial", trial.number, values, feasible))

    def _measure(self, trial: optuna.Trial) -> list[float]:
        data = self.space.suggest(trial)
        trial.set_user_attr("config", self.space.values(data))
        t0 = time.perf_counter()
        seeds = evaluate(
            self.sc,
            self.plan.policy,
            data,
            self.plan.seeds,
            self.goals.metrics,
            self.cache,
            self._stop,
        )
        trial.set_user_attr("seeds", seeds)
        ran = min(len(v) for v in seeds.values())
        if ran < len(self.plan.seeds):
            cs = self.goals.constraints
            broken = ", ".join(c.text for c in cs if c.violation(seeds[c.metric.name]) > 0)
            trial.set_user_attr("note", f"{broken} on seed {self.plan.seeds[ran - 1]}: stopped")
        trial.set_user_attr("wall_s", round(time.perf_counter() - t0, 3))
        for c in self.goals.constraints:  # the samplers read them (optuna >= 5)
            trial.set_constraint(c.text, c.violation(seeds[c.metric.name]))
        return [fmean(seeds[o.name]) for o in self.goals.objectives]

    def _stop(self, values: dict[str, list[float]]) -> bool:
        """After a seed: stop when the parent is gone, or when a constraint is already broken
        (a constraint is judged on the worst seed, so more seeds cannot mend it)."""
        if os.getppid() != self.parent:
            raise SystemExit(0)
        return any(c.violation(values[c.metric.name]) > 0 for c in self.goals.constraints)


def _work(plan: Plan, index: int, lock: Lock, events: Queue[tuple[Any, ...]]) -> None:
    try:
        _Worker(plan, index).run(lock, events)
    except BaseException:
        events.put(("error", index, traceback.format_exc()))
    finally:
        events.put(("exit", index))


def search(
    plan: Plan,
    space: Space,
    goals: Goals,
    jobs: int,
    on_trial: Callable[[int, list[float] | None, bool], None] | None = None,
) -> optuna.Study:
    """Create the study, queue the starting config, and run `jobs` worker processes on it.

    Args:
        plan: the run.
        space: its search space (for the starting config's parameters).
        goals: its objectives (for the study's directions).
        jobs: worker processes.
        on_trial: called in this process as each trial ends (number, objectives or None when
            the trial failed, feasible).

    Returns:
        The study, reloaded from its journal.

    Raises:
        RuntimeError: a worker failed (with its traceback).
    """
    _quiet()
    plan.journal.unlink(missing_ok=True)
    study = optuna.create_study(
        study_name=STUDY,
        storage=open_storage(plan.journal),
        directions=[optuna.study.StudyDirection[o.direction.upper()] for o in goals.objectives],
    )
    study.set_user_attr("seeds", list(plan.seeds))
    study.enqueue_trial(space.defaults(), user_attrs={"label": "defaults"})
    ctx = multiprocessing.get_context("spawn")
    lock, events = ctx.Lock(), ctx.Queue()
    procs = [
        ctx.Process(target=_work, args=(plan, k, lock, events), daemon=True) for k in range(jobs)
    ]
    for p in procs:
        p.start()
    errors = []
    try:
        running = len(procs)
        while running:
            try:
                msg = events.get(timeout=1.0)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break  # a worker killed without a word (out of memory, a signal)
                continue
            if msg[0] == "trial" and on_trial is not None:
                on_trial(msg[1], msg[2], msg[3])
            elif msg[0] == "error":
                errors.append(f"worker {msg[1]}:\n{msg[2]}")
            elif msg[0] == "exit":
                running -= 1
    finally:
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.terminate()
    if errors:
        raise RuntimeError("a tuning worker failed: " + "\n".join(errors))
    crashed = [p.exitcode for p in procs if p.exitcode]
    if crashed:
        raise RuntimeError(f"tuning workers died with exit codes {crashed}")
    return optuna.load_study(study_name=STUDY, storage=open_storage(plan.journal))


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
