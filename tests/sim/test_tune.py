"""`llmflow sim tune`: a real search (optuna, 2 worker processes) on a small scenario, its
outputs, the constraint re-checked by simulating the tuned config again through `run_scenario`,
and the errors for bad objectives, constraints and knobs.
"""

from __future__ import annotations

import argparse
import csv
import shlex
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml

from llmflow._core import Runtime
from llmflow.config import load_settings
from llmflow.sim.cli import add_commands
from llmflow.sim.runner import run_scenario
from llmflow.sim.scenario import load_scenario
from llmflow.sim.tuning.cli import _options
from llmflow.sim.tuning.plan import TuneOptions
from llmflow.sim.tuning.space import Space, base_config

SCENARIO = Path(__file__).with_name("tune_small.yaml")
BOUND = 0.3  # s, chat's TTFT p99: the starting config meets it, most of the space does not
SEEDS = (3, 4, 5)  # the scenario's seed + 0..2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmflow")
    add_commands(p.add_subparsers())
    return p


def _tune(*argv: str) -> int:
    args = _parser().parse_args(["sim", "tune", *argv])
    status: int = args.func(args)
    return status


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small scenario, copied where a re-run may write beside it."""
    path = tmp_path_factory.mktemp("scenario") / "small.yaml"
    path.write_text(SCENARIO.read_text(encoding="utf-8"), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tuned(scenario: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real tuning run: 8 trials x 3 seeds in 2 processes, 1 held-out seed."""
    out = tmp_path_factory.mktemp("tune")
    status = _tune(
        str(scenario),
        "--objective",
        "goodput",
        "--constraint",
        f"chat.ttft_p99<={BOUND}",
        "--trials",
        "8",
        "--jobs",
        "2",
        "--holdout-seeds",
        "1",
        "--out",
        str(out),
        "--no-progress",
    )
    assert status == 0
    return out


def _trials(out: Path) -> list[dict[str, str]]:
    with (out / "trials.csv").open(encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _get(data: dict[str, Any], path: str) -> Any:
    """`tiers[batch].shed_at` in a config, resolved here rather than with the code under test."""
    node: Any = data
    for part in path.split("."):
        key, _, sel = part.partition("[")
        node = node[key]
        if sel:
            node = next(t for t in node if t["name"] == sel.rstrip("]"))
    return node


def _chosen(rows: list[dict[str, str]]) -> dict[str, str]:
    feasible = [r for r in rows if r["feasible"] == "yes"]
    return max(feasible, key=lambda r: (float(r["goodput (max, mean)"]), -int(r["trial"])))


def test_tune_writes_every_output(tuned: Path) -> None:
    names = {p.name for p in tuned.iterdir()}
    assert {
        "tuned.yaml",
        "pareto.png",
        "trials.csv",
        "trials.md",
        "holdout.md",
        "study.journal",
    } <= names
    assert (tuned / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = _trials(tuned)
    assert [int(r["trial"]) for r in rows] == list(range(8))  # exactly --trials, shared study
    assert rows[0]["note"].startswith("defaults")  # trial 0 is the starting config
    md = (tuned / "trials.md").read_text(encoding="utf-8")
    assert md.count("\n| ") == 1 + 8  # header + one row per trial
    holdout = (tuned / "holdout.md").read_text(encoding="utf-8")
    assert f"`chat.ttft_p99<={BOUND:g}` on every held-out seed" in holdout
    assert "seeds 1003 (the search used 3, 4, 5)" in holdout


def test_tuned_yaml_is_the_best_feasible_trial_and_loads(tuned: Path, scenario: Path) -> None:
    rows = _trials(tuned)
    best = _chosen(rows)
    text = (tuned / "tuned.yaml").read_text(encoding="utf-8")
    assert f"# Chosen: trial {best['trial']}:" in text
    settings = load_settings(tuned / "tuned.yaml")  # as `llmflow serve --config` reads it
    Runtime(settings.to_runtime())  # and the core accepts it (tier order)
    data = yaml.safe_load(text)
    assert "backends" not in data
    knobs = [k for k in rows[0] if "." in k and "(" not in k]
    assert "gate.max_concurrency_per_gpu" in knobs
    assert "tiers[bulk].shed_at" not in knobs  # tiers are the config's, not the classes'
    assert {"tiers[normal].shed_at", "tiers[batch].max_share", "sla.ttft_ms"} <= set(knobs)
    for path in knobs:
        want = None if best[path] == "off" else float(best[path])
        got = _get(data, path)
        assert (got is None and want is None) or float(got) == pytest.approx(want), path
    # everything not searched is the starting config's
    start = load_settings(data=base_config(load_scenario(scenario), "llmflow"))
    assert settings.timeouts == start.timeouts
    assert settings.tenants == start.tenants


def test_tuned_config_meets_the_constraint_when_simulated_again(
    tuned: Path, scenario: Path
) -> None:
    rows = _trials(tuned)
    assert any(r["feasible"] == "no" for r in rows), "the constraint never bound: weak test"
    config = yaml.safe_load((tuned / "tuned.yaml").read_text(encoding="utf-8"))
    data = yaml.safe_load(scenario.read_text(encoding="utf-8"))
    data["policies"] = {"tuned": {"preset": "llmflow", "config": config}}
    rerun = scenario.with_name("rerun.yaml")
    rerun.write_text(yaml.safe_dump(data), encoding="utf-8")
    sc = load_scenario(rerun)
    for seed in SEEDS:
        report, _ = run_scenario(sc, seed=seed)
        p99 = report["policies"]["tuned"]["classes"]["chat"]["ttft_s"]["p99"]
        assert p99 is not None
        assert p99 <= BOUND, f"seed {seed}: chat TTFT p99 {p99} s > {BOUND} s"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--objective", "speed"], "unknown metric 'speed'"),
        (["--objective", "ttft_p99"], "did you mean chat.ttft_p99"),
        (["--objective", "chat.speed"], "unknown metric 'chat.speed'"),
        (["--objective", "nobody.ttft_p99"], "unknown class 'nobody'"),
        (["--constraint", "chat.ttft_p99<1"], "use <= or >="),
        (["--constraint", "chat.ttft_p99<=1.5s"], "not a number"),
        (["--constraint", "fast please"], "is not METRIC<=NUMBER"),
        (["--knob", "gate.speed"], "unknown knob ['gate.speed']"),
        (["--policy", "direct"], "no knobs to tune"),
        (["--policy", "nope"], "unknown policy 'nope'"),
        (["--trials", "0"], "--trials must be at least 1"),
    ],
)
def test_bad_goals_fail_before_any_work(
    scenario: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    out = tmp_path / "out"
    assert _tune(str(scenario), "--out", str(out), *argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert message in err
    assert not out.exists()


def test_unknown_metric_lists_the_known_ones(
    scenario: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _tune(str(scenario), "--objective", "speed") == 2
    err = capsys.readouterr().err
    for name in ("goodput", "makespan", "lost", "ttft_p99", "completed_frac", "chat, bulk"):
        assert name in err


def test_space_keeps_shed_at_non_increasing_and_starts_at_the_defaults(scenario: Path) -> None:
    sc = load_scenario(scenario)
    base = base_config(sc, "llmflow")
    space = Space(base)
    again = space.suggest(optuna.trial.FixedTrial(space.defaults()))
    assert again == base
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=5))
    offs = 0
    for _ in range(200):
        trial = study.ask()
        data = space.suggest(trial)
        study.tell(trial, 0.0)
        shed = [t["shed_at"] for t in data["tiers"]]
        assert shed == sorted(shed, reverse=True)
        Runtime(load_settings(data=data).to_runtime())  # the core's own validation
        offs += data["sla"]["ttft_ms"] is None
    assert 0 < offs < 200  # "off" is one of the choices, not the only one


def test_help_lists_knobs_and_metrics(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["sim", "tune", "--help"])
    text = capsys.readouterr().out
    for word in (
        "--objective",
        "--constraint",
        "--trials",
        "--jobs",
        "--seeds",
        "--holdout-seeds",
        "--timeout",
        "gate.max_concurrency_per_gpu",
        "tiers[*].shed_at",
        "sla.ttft_ms",
        "<class>.ttft_p50",
        "goodput",
    ):
        assert word in text


def test_two_objectives_front_choice_and_plot(scenario: Path, tmp_path: Path) -> None:
    """On hand-made trials: the front holds the feasible non-dominated ones, tuned.yaml's pick is
    the feasible trial best on the first objective (near-ties go to the second), and the tables
    and plot are written."""
    from llmflow.sim.tuning.outputs import choose, rows_of, write_tables
    from llmflow.sim.tuning.pareto import write_pareto
    from llmflow.sim.tuning.plan import Goals

    sc = load_scenario(scenario)
    goals = Goals(sc, ["goodput", "chat.ttft_p99"], ["lost<=0"])
    study = optuna.create_study(directions=["maximize", "minimize"])
    # (goodput, chat ttft p99, lost): 2 is best on goodput but loses requests; 4 is as good as
    # 1 on goodput (within 0.1%) and better on TTFT
    for goodput, ttft, lost in [
        (5.0, 0.4, 0),
        (6.0, 0.9, 0),
        (9.0, 0.3, 4),
        (4.0, 0.5, 0),
        (5.998, 0.6, 0),
    ]:
        seeds = {"goodput": [goodput] * 3, "chat.ttft_p99": [ttft] * 3, "lost": [lost, 0, 0]}
        study.add_trial(
            optuna.trial.create_trial(
                values=[goodput, ttft],
                constraints={"lost<=0": float(lost)},
                user_attrs={"seeds": seeds, "config": {"gate.max_concurrency_per_gpu": 8}},
            )
        )
    rows = rows_of(study, goals)
    assert [r.feasible for r in rows] == [True, True, False, True, True]
    assert [r.pareto for r in rows] == [True, True, False, False, True]
    assert [r.constraints for r in rows] == [[0], [0], [4], [0], [0]]  # the worst seed
    chosen = choose(rows, goals)
    assert chosen is not None
    assert chosen.number == 4
    write_tables(rows, goals, tmp_path, "# intro")
    lines = (tmp_path / "trials.md").read_text(encoding="utf-8").splitlines()
    assert lines[0] == "# intro"
    assert lines[5].startswith("| 1 | 8 | 6 | 0.9 | 0 | 3 | yes | yes |")
    png = write_pareto(rows, goals, chosen, tmp_path, "two objectives")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_lone_tier_lowered_pulls_the_unused_ones_below_it_down(scenario: Path) -> None:
    """Only `normal` has tenants: its shed_at is searched, `batch` (below it, unused) is not,
    yet a low `normal` must pull `batch` down with it, in the trial and in tuned.yaml alike."""
    sc = load_scenario(scenario)
    base = base_config(sc, "llmflow")
    base["tenants"] = [t for t in base["tenants"] if t["tier"] == "normal"]
    space = Space(base, ["tiers[*].shed_at"])
    assert space.paths == ["tiers[normal].shed_at"]
    data = space.suggest(optuna.trial.FixedTrial({"tiers[normal].shed_at": 0.25}))
    assert [t["shed_at"] for t in data["tiers"]] == [1.0, 0.25, 0.25]
    assert space.apply(space.values(data)) == data
    Runtime(load_settings(data=data).to_runtime())


def test_the_recorded_command_gives_back_the_options() -> None:
    # what trials.md and tuned.yaml record as the command parses to the same options
    options = TuneOptions(
        scenario="my scenario.yaml",
        objectives=("goodput", "chat.ttft_p99"),
        constraints=("chat.ttft_p99<=0.3",),
        ignore_slo=True,
        knobs=("gate.max_concurrency_per_gpu",),
        policy="tuned",
        trials=9,
        jobs=2,
        seeds=4,
        holdout_seeds=0,
        storage="sqlite:///s.db",
        study="again",
    )
    words = shlex.split(options.command())
    assert words[:3] == ["llmflow", "sim", "tune"]
    assert _options(_parser().parse_args(["sim", *words[2:]])) == options
