"""Where a tuning study lives, and what a worker on another machine needs to join it.

By default the study is a journal file in the output folder (optuna's `JournalFileBackend`),
which worker processes on one machine share through file locks. Given a URL it lives in a
store that workers on several machines reach: an RDB (`sqlite:///path`, `postgresql://...`,
`mysql+pymysql://...`, optuna's `RDBStorage`) or Redis (`redis://host:port/db`, optuna's
journal in Redis, `JournalRedisBackend`). Optuna assigns trial numbers in the store, so they
are unique across machines; we build no task queue of our own.

A worker that joins with only `--storage` and `--study` reads the rest of the plan from the
study itself: the coordinator stores it, the scenario's YAML text included, as a study
attribute, so every machine runs the same scenario, seeds, knobs and goals.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import optuna

from llmflow.sim.tuning.plan import Plan

__all__ = [
    "PLAN_ATTR",
    "StudyMissing",
    "has_study",
    "is_url",
    "open_storage",
    "plan_from_study",
    "store_plan",
    "wait_study",
]

PLAN_ATTR = "llmflow_plan"  # study user attribute: the plan as plain values
_SCHEMES = ("sqlite", "postgresql", "mysql", "oracle", "mssql", "redis", "rediss")


class StudyMissing(LookupError):
    """No study of that name (yet) in the storage."""


def is_url(storage: str) -> bool:
    """True for a storage URL (`scheme://...`), False for a journal file path."""
    scheme, sep, _ = storage.partition("://")
    return bool(sep) and scheme.split("+")[0] in _SCHEMES


def open_storage(storage: str, create: bool = True) -> optuna.storages.BaseStorage:
    """The study's storage, from a URL or a journal file path; `create=False` leaves an RDB's
    tables to the coordinator (two processes creating them at once collide).

    Raises:
        ValueError: a URL of a scheme optuna cannot store a study in.
    """
    from optuna.storages.journal import JournalFileBackend, JournalRedisBackend

    scheme, sep, _ = storage.partition("://")
    if not sep:
        return optuna.storages.JournalStorage(JournalFileBackend(storage))
    base = scheme.split("+")[0]
    if base in ("redis", "rediss"):
        with warnings.catch_warnings():  # "experimental" since optuna 3.1, and stable in use
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.JournalStorage(JournalRedisBackend(storage))
    if base in _SCHEMES:
        return _rdb(storage, create)
    raise ValueError(
        f"--storage {storage!r}: use a journal file path, sqlite:///PATH, postgresql://..., "
        "mysql://... or redis://HOST:PORT/DB"
    )


def _rdb(url: str, create: bool) -> optuna.storages.RDBStorage:
    """An RDB storage. A joiner polling an empty database while the coordinator creates the
    tables can win the insert of the schema version; the coordinator then just opens again."""
    from sqlalchemy.exc import IntegrityError, OperationalError

    for attempt in range(5):
        try:
            return optuna.storages.RDBStorage(url, skip_table_creation=not create)
        except (IntegrityError, OperationalError):
            if attempt == 4:
                raise
            time.sleep(0.2)
    raise AssertionError("unreachable")


def has_study(storage: optuna.storages.BaseStorage, name: str) -> bool:
    """Whether `name` already exists in `storage`."""
    return any(s.study_name == name for s in storage.get_all_studies())


def store_plan(study: optuna.Study, plan: Plan) -> None:
    """Record the plan (the scenario's text too) on the study, for workers that join it."""
    values = dataclasses.asdict(plan)
    values["scenario_text"] = plan.scenario.read_text(encoding="utf-8")
    values["scenario"] = plan.scenario.name
    study.set_user_attr(PLAN_ATTR, _plain(values))


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in values.items():
        if isinstance(v, Path):
            v = str(v)
        elif isinstance(v, tuple):
            v = list(v)
        elif isinstance(v, float) and v == float("inf"):
            v = None  # JSON has no infinity: no deadline
        out[k] = v
    return out


def wait_study(storage: str, name: str, wait_s: float) -> optuna.Study:
    """Load study `name`, waiting up to `wait_s` for a coordinator to create it (workers may
    start first).

    Raises:
        StudyMissing: still no such study (or no plan on it) after `wait_s`.
    """
    give_up = time.monotonic() + wait_s
    last_error = ""
    while True:
        try:
            store = open_storage(storage, create=False)
            if has_study(store, name):
                study = optuna.load_study(study_name=name, storage=store)
                if PLAN_ATTR in study.user_attrs:
                    return study
        except ValueError:
            raise
        except Exception as exc:  # not reachable yet, or no tables yet: each client its kind
            last_error = f" (last error: {type(exc).__name__}: {str(exc).splitlines()[0]})"
        if time.monotonic() >= give_up:
            raise StudyMissing(
                f"no llmflow study {name!r} in {storage} after {wait_s:g} s{last_error}: start "
                f"`llmflow sim tune SCENARIO --storage {storage} --study {name}` first"
            )
        time.sleep(0.5)


def plan_from_study(study: optuna.Study, storage: str) -> Plan:
    """The coordinator's plan, with the scenario written to a local temporary file (a scenario
    that names a profile file needs that file at the same path on this machine)."""
    v = dict(study.user_attrs[PLAN_ATTR])
    folder = Path(tempfile.mkdtemp(prefix="llmflow-tune-"))
    scenario = folder / v.pop("scenario")
    scenario.write_text(v.pop("scenario_text"), encoding="utf-8")
    return Plan(
        scenario=scenario,
        policy=v["policy"],
        objectives=tuple(v["objectives"]),
        constraints=tuple(v["constraints"]),
        knobs=None if v["knobs"] is None else tuple(v["knobs"]),
        seeds=tuple(v["seeds"]),
        trials=int(v["trials"]),
        deadline=float("inf") if v["deadline"] is None else float(v["deadline"]),
        storage=storage,
        study=study.study_name,
        sampler_seed=int(v["sampler_seed"]),
    )
