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
    assert (
        long["classes"]["chat"]["ttft_s"]["p99"] > 1.5 * short["classes"]["chat"]["ttft_s"]["p99"]
    )


def test_tenants_on_their_own_replicas_still_share_the_slots() -> None:
    """bulk floods its own replica; chat, alone on the other, still gets its slots: while
    chat waits, bulk's replica runs at most its share by waiting weight (half here), so
    chat's TTFT stays near the single gateway's instead of waiting out bulk's queue."""
    sc = load_scenario(SCENARIO)
    flood = [
        wc.model_copy(update={"arrival": wc.arrival.model_copy(update={"rate_per_s": 30.0})})
        if wc.name == "bulk"
        else wc
        for wc in sc.workload
    ]
    over = sc.model_copy(update={"workload": flood})
    reqs = build_requests(over, over.seed)
    one = run_policy(over, "one", over.policies["one"], reqs, over.seed).summary
    spec = over.policies["one"].model_copy(
        update={"replicas": ReplicaSpec(n=2, balance="by_tenant")}
    )
    split = run_policy(over, "one", spec, reqs, over.seed).summary
    assert split["peak_running"] <= CAP
    chat_one, chat_split = one["classes"]["chat"], split["classes"]["chat"]
    assert chat_split["completed"] == chat_split["arrived"]
    assert chat_split["ttft_s"]["p50"] < 2 * chat_one["ttft_s"]["p50"], (chat_one, chat_split)
