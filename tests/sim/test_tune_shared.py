"""`llmflow sim tune --storage URL`: one sweep shared by worker processes that reach the study
only through its storage, as workers on other machines would (a real redis-server, and sqlite).

The coordinator and two `--worker-only` joiners are separate `llmflow` processes; the study is
then read back with optuna directly, not through llmflow's tables.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import warnings
from typing import TYPE_CHECKING

import optuna
import pytest
import yaml

from llmflow.config import load_settings

if TYPE_CHECKING:
    from pathlib import Path

    from tests.processes import RedisProcess

SCENARIO = os.path.join(os.path.dirname(__file__), "tune_small.yaml")
TRIALS = 9
STUDY = "shared-sweep"


def _llmflow(*argv: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "llmflow.cli", "sim", "tune", *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def _store(url: str) -> optuna.storages.BaseStorage:
    """The storage, opened with optuna directly."""
    if not url.startswith("redis://"):
        return optuna.storages.RDBStorage(url)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        backend = optuna.storages.journal.JournalRedisBackend(url)
    return optuna.storages.JournalStorage(backend)


def _sweep(storage: str, tmp_path: Path) -> Path:
    """Two joiners started first (they wait for the study), then the coordinator."""
    out = tmp_path / "out"
    joiners = [
        _llmflow(
            "--worker-only",
            "--storage",
            storage,
            "--study",
            STUDY,
            "--jobs",
            "1",
            "--wait",
            "120",
            log=tmp_path / f"joiner-{k}.log",
        )
        for k in range(2)
    ]
    coordinator = _llmflow(
        SCENARIO,
        "--storage",
        storage,
        "--study",
        STUDY,
        "--trials",
        str(TRIALS),
        "--seeds",
        "2",
        "--jobs",
        "1",
        "--holdout-seeds",
        "0",
        "--constraint",
        "chat.completed_frac>=0.5",
        "--out",
        str(out),
        "--no-progress",
        log=tmp_path / "coordinator.log",
    )
    procs = [coordinator, *joiners]
    try:
        for k, p in enumerate(procs):
            code = p.wait(timeout=240)
            name = "coordinator.log" if k == 0 else f"joiner-{k - 1}.log"
            assert code == 0, (tmp_path / name).read_text(errors="replace")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["redis", "sqlite"])
def test_workers_share_one_study(kind: str, tmp_path: Path, redis_server: RedisProcess) -> None:
    storage = redis_server.url if kind == "redis" else f"sqlite:///{tmp_path / 'study.db'}"
    out = _sweep(storage, tmp_path)
    trials = optuna.load_study(study_name=STUDY, storage=_store(storage)).get_trials()
    counted = [t for t in trials if not t.user_attrs.get("surplus")]
    numbers = [t.number for t in counted]
    assert sorted(numbers) == list(range(TRIALS))  # the requested count, none twice
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in counted)
    assert len(trials) - len(counted) <= 3  # at most one surplus ask per worker process
    workers = {t.user_attrs["worker"] for t in counted if "worker" in t.user_attrs}
    assert len(workers) >= 2, workers  # the sweep ran in more than one process
    with (out / "trials.csv").open(encoding="utf-8") as f:
        assert [int(r["trial"]) for r in csv.DictReader(f)] == list(range(TRIALS))
    tuned = out / "tuned.yaml"
    settings = load_settings(tuned)  # the study's best config, as `llmflow serve` reads it
    assert settings.gate is not None
    assert "# Chosen: trial" in tuned.read_text(encoding="utf-8")
    assert yaml.safe_load(tuned.read_text(encoding="utf-8"))


def test_a_taken_study_name_is_refused(tmp_path: Path, redis_server: RedisProcess) -> None:
    storage = redis_server.url
    optuna.create_study(study_name=STUDY, storage=_store(storage))
    p = _llmflow(SCENARIO, "--storage", storage, "--study", STUDY, log=tmp_path / "c.log")
    assert p.wait(timeout=60) == 2
    text = (tmp_path / "c.log").read_text()
    assert f"study '{STUDY}' already exists in {storage}: pick a new --study NAME" in text


def test_worker_only_without_a_study_says_what_to_start(
    tmp_path: Path, redis_server: RedisProcess
) -> None:
    storage = redis_server.url
    p = _llmflow(
        "--worker-only",
        "--storage",
        storage,
        "--study",
        "nope",
        "--wait",
        "0.5",
        log=tmp_path / "w.log",
    )
    assert p.wait(timeout=60) == 2
    text = (tmp_path / "w.log").read_text()
    assert f"no llmflow study 'nope' in {storage} after 0.5 s" in text
    assert "--worker-only needs --storage" in _usage(tmp_path, "--worker-only")


def _usage(tmp_path: Path, *argv: str) -> str:
    p = _llmflow(*argv, log=tmp_path / "u.log")
    p.wait(timeout=60)
    return (tmp_path / "u.log").read_text()
