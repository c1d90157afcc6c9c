"""How gateway replicas sharing Redis behave, simulated (`sim/replicas.py`): the global cap as N
grows, TTFT against the number of replicas and Redis's round trip, a crashed replica's slots
against the lease TTL, and fairness when each tenant reaches only some replicas.

Runs `tests/sim/replicas_small.yaml` (one H100, a gate of 8, two tenants at 6 req/s each) with
its `three` policy's replica settings varied, and prints markdown tables for
`docs/simulator.md`. Each run is deterministic (seeded); the whole study takes seconds.

Usage: `python -m benchmarks.replica_sim`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmflow.sim.runner import run_policy
from llmflow.sim.scenario import ReplicaSpec, Scenario, load_scenario
from llmflow.sim.workload import build_requests

SCENARIO = Path(__file__).resolve().parents[1] / "tests" / "sim" / "replicas_small.yaml"


def _run(sc: Scenario, replicas: ReplicaSpec | None) -> dict[str, Any]:
    spec = sc.policies["one"].model_copy(update={"replicas": replicas})
    return run_policy(sc, "one", spec, build_requests(sc, sc.seed), sc.seed).summary


def _ttft(s: dict[str, Any], cls: str) -> str:
    t = s["classes"][cls]["ttft_s"]
    return f"{t['p50']:.2f} / {t['p99']:.2f}"


def scaling(sc: Scenario) -> None:
    """The cap and TTFT against N and the round trip."""
    print("| replicas | Redis RTT | peak running (cap 8) | lease denials | chat TTFT p50 / p99 s |")
    print("|---:|---:|---:|---:|---|")
    base = _run(sc, None)
    print(f"| 1 (no Redis) | - | {base['peak_running']} | - | {_ttft(base, 'chat')} |")
    for n in (2, 4, 8):
        for rtt in (0.5, 5.0, 20.0):
            s = _run(sc, ReplicaSpec(n=n, redis_rtt_ms=rtt))
            print(
                f"| {n} | {rtt:g} ms | {s['peak_running']} | {s['lease_denials']} | "
                f"{_ttft(s, 'chat')} |"
            )
        s = _run(sc, ReplicaSpec(n=n, shared=False))
        print(f"| {n}, no shared state | - | {s['peak_running']} | - | {_ttft(s, 'chat')} |")


def crash(sc: Scenario) -> None:
    """Replica 0 of 3 crashes at 10 s: its leases hold slots until they expire."""
    print("| lease TTL | peak running | chat failed | chat TTFT p50 / p99 s |")
    print("|---:|---:|---:|---|")
    for ttl in (1_000, 3_000, 10_000, 30_000):
        s = _run(sc, ReplicaSpec(n=3, lease_ttl_ms=ttl, crash_at_s=10))
        chat = s["classes"]["chat"]
        print(f"| {ttl / 1e3:g} s | {s['peak_running']} | {chat['failed']} | {_ttft(s, 'chat')} |")


def fairness(sc: Scenario) -> None:
    """bulk floods (30 req/s): chat's share when both reach every replica, and when each
    tenant reaches only its own (`balance: by_tenant`)."""
    flood = [
        wc.model_copy(update={"arrival": wc.arrival.model_copy(update={"rate_per_s": 30.0})})
        if wc.name == "bulk"
        else wc
        for wc in sc.workload
    ]
    over = sc.model_copy(update={"workload": flood})
    print("| replicas | routing | chat completed | chat TTFT p50 / p99 s | bulk TTFT p50 s |")
    print("|---|---|---:|---|---:|")
    for label, spec, routing in (
        ("1", None, "-"),
        ("3", ReplicaSpec(n=3), "round robin"),
        ("2", ReplicaSpec(n=2, balance="by_tenant"), "chat -> 0, bulk -> 1"),
        ("2, no shared state", ReplicaSpec(n=2, balance="by_tenant", shared=False), "same"),
    ):
        s = _run(over, spec)
        chat = s["classes"]["chat"]
        bulk = s["classes"]["bulk"]["ttft_s"]["p50"]
        print(
            f"| {label} | {routing} | {chat['completed']} / {chat['arrived']} | "
            f"{_ttft(s, 'chat')} | {bulk:.2f} |"
        )


def main() -> None:
    """Print the three tables."""
    sc = load_scenario(SCENARIO)
    scaling(sc)
    print()
    crash(sc)
    print()
    fairness(sc)


if __name__ == "__main__":
    main()
