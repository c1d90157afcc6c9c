"""What a tuning run is: the command's options, the plan its workers share, its goals, and the
evaluation of one config by simulation.

`TuneOptions` is what `llmflow sim tune` was asked (the command builds it from its arguments;
Python callers build it directly). `Plan` is the part every worker needs, in plain values, since
workers are spawned processes and may join from another machine (`storage.py` stores it on the
study). `Goals` parses the plan's objectives and constraints against the scenario, and
`evaluate` simulates one config on each seed and reads them.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmflow.sim.runner import run_policy
from llmflow.sim.tuning.goals import parse_constraint, parse_metric
from llmflow.sim.workload import build_requests

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path

    from llmflow.sim.scenario import Scenario
    from llmflow.sim.tuning.goals import Constraint, Metric
    from llmflow.sim.workload import Requests

__all__ = [
    "HOLDOUT_OFFSET",
    "STUDY",
    "TIMEOUT_S",
    "TRIALS",
    "Goals",
    "Plan",
    "TuneOptions",
    "evaluate",
]

TRIALS = 60  # default: the marketing flood's search takes ~6 min on 2 shared cores
TIMEOUT_S = 420.0  # default: no trial starts after 7 min, so a default run ends within 10
STUDY = "llmflow-tune"  # default study name (in study.journal, or in --storage)
HOLDOUT_OFFSET = 1000  # held-out seeds: the scenario's seed + 1000 + k, far from the search's


@dataclass(frozen=True)
class TuneOptions:
    """What `llmflow sim tune` was asked for; each field is the flag of the same name."""

    scenario: str | None = None  # a YAML path or a name; None only with worker_only
    objectives: tuple[str, ...] = ()  # empty: goodput
    constraints: tuple[str, ...] = ()  # as given, before the scenario's SLOs are added
    ignore_slo: bool = False
    knobs: tuple[str, ...] = ()  # empty: the whole table
    policy: str = "llmflow"
    trials: int = TRIALS
    jobs: int = field(default_factory=lambda: os.cpu_count() or 1)
    seeds: int = 3  # seeds per trial: the scenario's seed + 0..seeds-1
    holdout_seeds: int = 3  # 0 skips the held-out comparison
    timeout_s: float = TIMEOUT_S  # 0: no limit
    sampler_seed: int = 0
    out: Path | None = None  # None: sim-out/<scenario name>-tune
    storage: str | None = None  # None: out/study.journal
    study: str = STUDY
    worker_only: bool = False
    wait_s: float = 600.0  # worker_only: how long to wait for the study to exist
    progress: bool = True

    def problem(self) -> str | None:
        """What is wrong with this combination of options, or None."""
        if self.worker_only and not self.storage:
            return "--worker-only needs --storage URL: the study the coordinator created"
        if not self.worker_only and not self.scenario:
            return "a SCENARIO is needed (or --worker-only --storage URL to join a study)"
        jobs = 0 if self.storage and not self.worker_only else 1  # 0: others run the trials
        for name, low in (("trials", 1), ("jobs", jobs), ("seeds", 1), ("holdout_seeds", 0)):
            if getattr(self, name) < low:
                return f"--{name.replace('_', '-')} must be at least {low}"
        if self.timeout_s < 0:
            return "--timeout must be >= 0 (0: no limit)"
        return None

    def command(self) -> str:
        """The command that reproduces this search (so a run started from Python records one
        too)."""
        words = ["llmflow", "sim", "tune", str(self.scenario)]
        for flag, values in (
            ("--objective", self.objectives),
            ("--constraint", self.constraints),
            ("--knob", self.knobs),
        ):
            for v in values:
                words += [flag, v]
        words += ["--ignore-slo"] if self.ignore_slo else []
        words += ["--policy", self.policy, "--trials", str(self.trials)]
        words += ["--seeds", str(self.seeds), "--holdout-seeds", str(self.holdout_seeds)]
        words += ["--jobs", str(self.jobs)]
        if self.storage:
            words += ["--storage", self.storage, "--study", self.study]
        return " ".join(shlex.quote(w) for w in words)


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
