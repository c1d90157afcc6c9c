"""Workload generation: arrival processes, length distributions, traces."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llmflow.sim.scenario import Dist, Scenario, ScenarioError, load_scenario
from llmflow.sim.workload import build_requests, read_trace, sample_lengths

TRACES = Path(__file__).resolve().parents[2] / "sim" / "traces"


def _scenario(arrival: dict[str, Any], **lengths: Any) -> Scenario:
    wc = {"name": "c", "tenant": "t", "arrival": arrival, **lengths}
    if arrival["kind"] != "trace":
        wc.setdefault("prompt_tokens", {"kind": "fixed", "value": 10})
        wc.setdefault("output_tokens", {"kind": "fixed", "value": 5})
    return Scenario.model_validate({
        "title": "t", "seed": 3, "duration_s": 1000, "base_dir": TRACES,
        "cluster": [{"name": "h", "gpu": "h100", "model": "llama-3-8b"}], "workload": [wc]})


def test_poisson_rate_and_gaps() -> None:
    r = build_requests(_scenario({"kind": "poisson", "rate_per_s": 5.0}))
    assert len(r) == pytest.approx(5000, rel=0.05)
    gaps = np.diff(r.t)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential: CV 1


def test_burst_at_time() -> None:
    r = build_requests(_scenario({"kind": "burst", "at_s": 60, "count": 100, "over_s": 10}))
    assert len(r) == 100
    assert r.t[0] == 60.0
    assert r.t[-1] < 70.0


def test_onoff_is_silent_when_off() -> None:
    r = build_requests(_scenario({"kind": "onoff", "rate_per_s": 10.0, "on_s": 10, "off_s": 30}))
    assert np.all(np.mod(r.t, 40.0) < 10.0)
    assert len(r) == pytest.approx(10 * 250, rel=0.1)


def test_trace_replay_keeps_times_and_lengths() -> None:
    r = build_requests(_scenario({"kind": "trace", "path": "azure2023_code.csv",
                                  "time_scale": 4.0}))
    raw = read_trace(TRACES / "azure2023_code.csv")
    assert len(r) == len(raw["t"]) == 8819
    assert r.t[-1] == pytest.approx(raw["t"][-1] / 4.0)
    assert (r.prompt == np.maximum(raw["prompt"], 1)).all()
    assert (r.max_tokens == r.eos).all()  # ignore_eos style: ask exactly what the trace made


def test_length_distributions() -> None:
    rng = np.random.default_rng(1)
    x = sample_lengths(Dist(kind="lognormal", median=200, sigma=0.5, max=1000), 20_000, rng,
                       TRACES)
    assert np.median(x) == pytest.approx(200, rel=0.03)
    assert x.max() <= 1000
    u = sample_lengths(Dist(kind="uniform", low=5, high=7), 1000, rng, TRACES)
    assert set(u.tolist()) == {5, 6, 7}
    e = sample_lengths(Dist(kind="empirical", path="azure2023_conv.csv",
                            column="GeneratedTokens"), 20_000, rng, TRACES)
    assert np.median(e) == pytest.approx(129, rel=0.1)  # the trace's p50


def test_same_seed_same_requests_and_classes_are_independent() -> None:
    sc = _scenario({"kind": "poisson", "rate_per_s": 1.0})
    a, b, c = build_requests(sc, 1), build_requests(sc, 1), build_requests(sc, 2)
    assert (a.t == b.t).all()
    assert len(a) != len(c) or not (a.t == c.t).all()


def test_bad_scenarios_are_explained(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("title: x\nduration_s: 10\ncluster: []\nworkload: []\n")
    with pytest.raises(ScenarioError, match="cluster"):
        load_scenario(bad)
    with pytest.raises(ValueError, match="needs"):
        Dist(kind="lognormal", median=3)


def test_prefix_workload_shares_system_prompts_and_chat_history() -> None:
    """Every prompt opens with one of the system prompts' blocks; a chat's next turn resends
    its history, so its prompt is the last one plus the answer and the new message, and its
    hash ids extend the last turn's full blocks; a chat past `max_context` starts over."""
    prefix = {"block_tokens": 16, "system_prompts": 2, "system_tokens": 64,
              "conversations": 1, "max_context": 500}
    r = build_requests(_scenario(
        {"kind": "poisson", "rate_per_s": 1.0, "max_requests": 8},
        prompt_tokens={"kind": "fixed", "value": 40}, output_tokens={"kind": "fixed", "value": 60},
        prefix=prefix))
    assert r.hash_ids is not None
    prompts, ids = r.prompt.tolist(), list(r.hash_ids)
    assert prompts[:3] == [64 + 40, 64 + 140, 64 + 240]  # system + history + new message
    for turn in range(1, len(prompts)):
        assert len(ids[turn]) == prompts[turn] // 16
        if prompts[turn] > prompts[turn - 1]:
            assert ids[turn][: len(ids[turn - 1])] == ids[turn - 1]  # the last turn's blocks
        else:  # started over: the same system prompt, a new chat
            assert ids[turn][:4] == ids[0][:4]
            assert ids[turn][4] != ids[0][4]
    assert any(p < q for p, q in zip(prompts[1:], prompts, strict=False))  # one start-over
