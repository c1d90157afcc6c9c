"""Tuning workers: the processes that ask the study for trials, simulate them and tell the
results, on the coordinator's machine (`search`) or on any other that joins the study (`join`).

Each worker is a spawned process with its own TPE sampler (multivariate, with a constant liar
so parallel workers do not propose the same point; it reads the constraints each trial sets).
A lock taken around "count, then ask" keeps one machine's workers from asking past `--trials`;
across machines the storage numbers trials uniquely, and a worker handed a number at or past
`--trials` marks that trial surplus (failed, left out of every table) and stops, so trials
0..N-1 are the study.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import random
import socket
import sys
import time
import traceback
import warnings
from statistics import fmean
from typing import TYPE_CHECKING, Any

import optuna

from llmflow._core import ConfigError
from llmflow.config import ConfigFileError
from llmflow.sim.scenario import load_scenario
from llmflow.sim.tuning.plan import Goals, evaluate
from llmflow.sim.tuning.space import Space, base_config
from llmflow.sim.tuning.storage import open_storage

if TYPE_CHECKING:
    from collections.abc import Callable
    from multiprocessing.queues import Queue
    from multiprocessing.synchronize import Lock

    from llmflow.sim.tuning.plan import Plan
    from llmflow.sim.workload import Requests

__all__ = ["Once", "await_elsewhere", "join", "quiet", "run_workers"]

_STARTUP = 10  # random trials before TPE models the results (fewer on short runs)


def quiet() -> None:
    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
    optuna.logging.set_verbosity(optuna.logging.WARNING)


class _Worker:
    def __init__(self, plan: Plan, index: int):
        quiet()
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
            study_name=plan.study, storage=open_storage(plan.storage, create=False), sampler=sampler
        )
        self.cache: dict[int, Requests] = {}
        self.parent = os.getppid()

    def run(self, lock: Lock, events: Queue[tuple[Any, ...]]) -> None:
        while time.time() < self.plan.deadline and os.getppid() == self.parent:
            with lock:
                if len(self.study.get_trials(deepcopy=False)) >= self.plan.trials:
                    return
                trial = self.study.ask()
            if trial.number >= self.plan.trials:  # another machine's worker filled the study
                trial.set_user_attr("surplus", True)
                self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
                return
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
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
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


def join(
    plan: Plan,
    jobs: int,
    on_trial: Callable[[int, list[float] | None, bool], None] | None = None,
) -> None:
    """Run `jobs` worker processes on a study another machine created, until it holds its
    trials (or its deadline passes).

    Raises:
        RuntimeError: a worker failed (with its traceback).
    """
    quiet()
    # Samplers seeded apart from the coordinator's (which use sampler_seed + 0..jobs-1).
    first = 1 + random.SystemRandom().randrange(1 << 20) * 64
    run_workers(plan, jobs, first, on_trial)


def run_workers(
    plan: Plan,
    jobs: int,
    first: int,
    on_trial: Callable[[int, list[float] | None, bool], None] | None,
) -> None:
    ctx = multiprocessing.get_context("spawn")
    lock, events = ctx.Lock(), ctx.Queue()
    procs = [
        ctx.Process(target=_work, args=(plan, first + k, lock, events), daemon=True)
        for k in range(jobs)
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


class Once:
    """Reports each trial's end once, whether a local worker said so or the storage did."""

    def __init__(self, on_trial: Callable[[int, list[float] | None, bool], None] | None):
        self.on_trial = on_trial
        self.reported: set[int] = set()

    def __call__(self, number: int, values: list[float] | None, ok: bool) -> None:
        if number not in self.reported and self.on_trial is not None:
            self.on_trial(number, values, ok)
        self.reported.add(number)


_LIVE = (optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.WAITING)
_STALLED_S = 120.0  # give up on trials still running elsewhere after this long without news


def await_elsewhere(
    study: optuna.Study,
    plan: Plan,
    on_trial: Once,
) -> None:
    """Wait until trials 0..N-1 have all ended (workers on other machines may still run some),
    or the deadline has passed with none running; report each as it ends. A worker killed
    mid-trial leaves its trial running for ever: after `_STALLED_S` (or five times the longest
    trial) without one ending, stop waiting and say so."""
    last_news, longest = time.monotonic(), 0.0
    while True:
        mine = [t for t in study.get_trials(deepcopy=False) if t.number < plan.trials]
        for t in mine:
            if t.state not in _LIVE and t.number not in on_trial.reported:
                feasible = t.values is not None and all(v <= 0 for v in t.constraints.values())
                on_trial(t.number, None if t.values is None else list(t.values), feasible)
                last_news = time.monotonic()
            longest = max(longest, float(t.user_attrs.get("wall_s", 0.0)))
        live = [t.number for t in mine if t.state in _LIVE]
        if not live and (len(mine) >= plan.trials or time.time() >= plan.deadline):
            return
        if time.monotonic() - last_news > max(_STALLED_S, 5 * longest):
            print(f"gave up waiting for trials {live} (their workers went silent)", file=sys.stderr)
            return
        time.sleep(0.5)
