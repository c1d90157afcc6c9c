"""What the client signals change in the incident replays (issue 29), with one gateway and with
three replicas behind a round-robin balancer.

A simulated client's retry carries what an SDK's headers say (its retries so far, its timeout):
`docs/simulator.md`, "Client signals". Behind one gateway the fingerprint memory already knows
every retry; behind replicas a retry usually lands on another replica, whose memory has never
seen it, so only the retry count says it is late. This runs `marketing-flood` and `brownout`
with the scenario's `llmflow` policy as it ships, once with `signals` on and once off, on 1 and
3 replicas (the same seed and requests in every run), and prints a markdown table for
`docs/simulator.md`. Deterministic; about 30 s.

Usage: `python -m benchmarks.signals_replay`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmflow.sim.runner import run_policy
from llmflow.sim.scenario import PolicySpec, ReplicaSpec, Scenario, load_scenario
from llmflow.sim.workload import build_requests

ROOT = Path(__file__).resolve().parents[1]
INCIDENTS = {
    "marketing flood": (ROOT / "sim" / "incidents" / "marketing-flood.yaml", "business"),
    "brownout": (ROOT / "sim" / "scenarios" / "brownout.yaml", "chat"),
}


def _spec(sc: Scenario, signals: bool, replicas: int) -> PolicySpec:
    base = sc.policies["llmflow"]
    config = {**base.config, "signals": {"retry_headers": signals, "deadline_headers": signals}}
    return base.model_copy(update={
        "preset": "llmflow",
        "config": config,
        "replicas": ReplicaSpec(n=replicas) if replicas > 1 else None,
    })


def _row(incident: str, cls: str, replicas: int, signals: bool, s: dict[str, Any]) -> str:
    c = s["classes"][cls]
    ttft = c["ttft_s"]
    done = sum(k["completed"] for k in s["classes"].values())
    cut = sum(k["truncated"] for k in s["classes"].values())
    lost = sum(k["timed_out"] + k["failed"] for k in s["classes"].values())
    return (
        f"| {incident} | {replicas} | {'on' if signals else 'off'} | {done} + {cut} cut | {lost} | "
        f"{cls} {ttft['p50']:.2f} / {ttft['p99']:.2f} | {s['preemptions']} | "
        f"{s['goodput_rps']:.3f} |"
    )


def main() -> None:
    print("| incident | replicas | signals | completed | timed out or failed | "
          "TTFT p50 / p99 (s) | preemptions | goodput/s |")
    print("|---|---:|---|---:|---:|---|---:|---:|")
    for incident, (path, cls) in INCIDENTS.items():
        sc = load_scenario(path)
        reqs = build_requests(sc, sc.seed)
        for replicas in (1, 3):
            for signals in (False, True):
                run = run_policy(sc, "llmflow", _spec(sc, signals, replicas), reqs, sc.seed)
                print(_row(incident, cls, replicas, signals, run.summary), flush=True)


if __name__ == "__main__":
    main()
