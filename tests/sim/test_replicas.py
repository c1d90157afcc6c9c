"""N gateway replicas in the simulator (`sim/replicas.py`): each replica a real `Runtime`, the
Redis protocol replayed in simulated time. Counted by the simulated engine (its own peak of
running requests) and by what the clients saw."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmflow.sim.runner import run_policy
from llmflow.sim.scenario import ReplicaSpec, load_scenario
from llmflow.sim.workload import build_requests

SCENARIO = Path(__file__).with_name("replicas_small.yaml")
CAP = 8  # gate.max_concurrency_per_gpu x 1 GPU, in the scenario


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    sc = load_scenario(SCENARIO)
    reqs = build_requests(sc, sc.seed)
    return {
        name: run_policy(sc, name, spec, reqs, sc.seed).summary
        for name, spec in sc.policies.items()
    }


def test_shared_leases_hold_the_cap_across_replicas(runs: dict[str, Any]) -> None:
    assert runs["one"]["peak_running"] == CAP
    assert runs["three"]["peak_running"] == CAP  # reached, never passed
    assert runs["three"]["lease_denials"] > 0  # the replicas did race for the last slots
    assert runs["three-unshared"]["peak_running"] > CAP  # each replica on the whole cap
    for name in ("one", "three"):
        classes = runs[name]["classes"]
        assert all(c["completed"] == c["arrived"] for c in classes.values()), classes


def _crash(ttl_ms: float) -> dict[str, Any]:
    sc = load_scenario(SCENARIO)
    spec = sc.policies["three"].model_copy(
        update={"replicas": ReplicaSpec(n=3, lease_ttl_ms=ttl_ms, crash_at_s=10)}
    )
    return run_policy(sc, "three", spec, build_requests(sc, sc.seed), sc.seed).summary


def test_a_crashed_replicas_slots_stay_taken_until_the_ttl() -> None:
    short, long = _crash(1000), _crash(30_000)
    for s in (short, long):
        assert s["peak_running"] <= CAP
        assert s["classes"]["chat"]["failed"] > 0  # the crashed replica's own requests
    # the dead replica's leases hold slots for the TTL: the others' waits grow with it
    assert long["classes"]["chat"]["ttft_s"]["p99"] > 2 * short["classes"]["chat"]["ttft_s"]["p99"]
