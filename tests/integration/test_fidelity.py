"""Simulator fidelity against real vLLM: calibrate, then predict a different workload.

`llmflow calibrate`'s measurement (`llmflow.calibrate.calibrate`) times the session's vLLM
server before and after the real run (the pooled fit brackets the run's conditions); the
simulator then runs `fidelity.yaml` (random arrivals and mixed lengths, then a burst
that queues in the gateway: nothing like the calibration sweeps) with that profile, and the same
requests are replayed through the real gateway to the real vLLM. docs/fidelity.md explains the
figures, the thresholds below and what the simulator gets wrong.

The test's own load (client, gateway) runs on the CPUs vLLM's pinned worker does not use, and
the time vLLM's threads spent waiting for a CPU is measured and printed with the table.

Environment: `LLMFLOW_FIDELITY_RUNS=N` replays the workload N times (the spread of the real
runs is the noise floor); `LLMFLOW_FIDELITY_OUT=FILE` writes the report there.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

import fidelity
import pytest
from cpu import Sched, SchedClock, pinned, spare_cpus
from gateway_server import GatewayProcess, gateway_config
from gwtools import wait_vllm_idle

from llmflow.calibrate import Calibration, calibrate, stream_request
from llmflow.gateway.http1 import ConnectionPool
from llmflow.sim.profile import Profile, StepModel, pooled

if TYPE_CHECKING:
    from vllm_server import VllmServer

pytestmark = pytest.mark.integration

# vLLM's limits that /metrics does not publish: --max-num-seqs from DEFAULT_ARGS, and the CPU
# build's default --max-num-batched-tokens for the API server (vllm/engine/arg_utils.py).
ENGINE = {"max_num_seqs": 16, "max_num_batched_tokens": 2048}
SWEEP = {"concurrency": (1, 4, 8, 16), "contexts": (32, 1024)}  # lean: two calibrations per run
# Gross bounds only: on 2 shared cores the same real workload varies 20-49% run to run (see
# docs/fidelity.md), so the 15% target is reported, not asserted. What is asserted robustly is
# discrimination: the calibrated profile must beat deliberately wrong ones by a wide margin.
MEDIAN_LIMIT = 0.60  # median |error| over the seven figures (target 0.15; see docs/fidelity.md)
EACH_LIMIT = 1.00  # every figure but the p99s within this (p99s: reported, not bounded)
MARGIN = 2.0  # a wrong profile's median error must be at least this many times the calibrated
WRONG = (3.0, 1 / 3)  # profiles with every cost scaled so must fail the same check
HOP_PAIRS = 12  # idle requests timed direct and through the gateway, alternately


def _score(sim: dict[str, float], real: dict[str, float]) -> tuple[float, float]:
    """(median |error| over every figure, worst |error| over the figures but the p99s)."""
    rows = fidelity.compare(sim, real)
    errors = [abs(err) for *_, err in rows]
    bounded = [abs(err) for name, *_, err in rows if "p99" not in name]
    return statistics.median(errors), max(bounded)


async def _gateway_hop(vllm_url: str, gateway_url: str) -> float:
    """Median extra first-token time of an idle request through the gateway (its own cost,
    which the simulator does not model: it is added to the profile's frontend latency)."""
    pool = ConnectionPool(connect_timeout_s=10.0)
    rng = random.Random()
    times: dict[str, list[float]] = {vllm_url: [], gateway_url: []}
    try:
        for _ in range(HOP_PAIRS):
            for url, out in times.items():
                prompt = [rng.randrange(100, 4000) for _ in range(64)]
                out.append((await stream_request(pool, url, "tiny", prompt, 2)).ttft_s)
                await asyncio.sleep(0.02)
    finally:
        pool.close()
    return max(0.0, statistics.median(times[gateway_url]) - statistics.median(times[vllm_url]))


def _calibrate(url: str) -> Profile:
    cal = Calibration(url, engine=dict(ENGINE), **SWEEP)  # type: ignore[arg-type]
    return asyncio.run(calibrate(cal))


def _drift(a: Profile, b: Profile) -> float:
    """How far apart two calibrations predict a 512-token first token and a 8 x 600 decode
    step: the change of conditions between them."""
    def points(p: Profile) -> tuple[float, float]:
        s = p.step_s
        return (p.frontend_s + s.step_time(512, 512 * 512, 0, 0), s.step_time(0, 0, 8, 4800))
    return max(abs(x - y) / min(x, y) for x, y in zip(points(a), points(b), strict=True))


@pytest.mark.timeout(900)  # about 75 s here; twice that on a busy machine, plus a vLLM start
def test_simulator_predicts_real_vllm_through_the_gateway(
    vllm_server: VllmServer, tmp_path: Path
) -> None:
    """Warm up, calibrate, replay, calibrate again; simulate with both calibrations pooled.
    Median error within MEDIAN_LIMIT and every figure within EACH_LIMIT; scaled profiles must
    fail."""
    wait_vllm_idle(vllm_server)
    assert vllm_server.process is not None
    spare = spare_cpus(vllm_server.process.pid)
    clock = SchedClock(vllm_server.process.pid)
    runs = int(os.environ.get("LLMFLOW_FIDELITY_RUNS", "1"))
    with pinned(spare):
        sc = fidelity.load(tmp_path / "profile.yaml")  # written below, before it is simulated
        config = gateway_config(vllm_server.url, **fidelity.gateway_sections(sc))
        with GatewayProcess(config, tmp_path) as gw:
            # Warm-up: a fresh vLLM is much slower on batch shapes it has not run yet; other
            # draws of the same workload bring it to the steady state of a long-running server.
            asyncio.run(fidelity.replay(sc, gw.url, seed=sc.seed + 1))
            clock.lap()
            before = _calibrate(vllm_server.url)
            scheds = [clock.lap()]
            hop = asyncio.run(_gateway_hop(vllm_server.url, gw.url))
            reals = []
            for _ in range(runs):
                wait_vllm_idle(vllm_server)
                clock.lap()
                outcomes = asyncio.run(fidelity.replay(sc, gw.url))
                scheds.append(clock.lap())
                failed = [o for o in outcomes if o.status != "completed"]
                assert not failed, failed[:5]
                reals.append(fidelity.summarise(outcomes))
        after = _calibrate(vllm_server.url)
        scheds.append(clock.lap())
    vllm_profile = pooled([before, after])
    profile = vllm_profile.model_copy(update={"frontend_s": vllm_profile.frontend_s + hop})
    profile.dump(tmp_path / "profile.yaml")
    sim = fidelity.summarise(fidelity.simulate(sc))
    real = reals[0]
    median, worst = _score(sim, real)
    report = _report(vllm_profile, hop, fidelity.compare(sim, real), median, worst, spare,
                     scheds, reals, _drift(before, after))
    print("\n" + report)
    if out := os.environ.get("LLMFLOW_FIDELITY_OUT"):
        Path(out).write_text(report + "\n", encoding="utf-8")
    assert median <= MEDIAN_LIMIT, report
    assert worst <= EACH_LIMIT, report
    for factor in WRONG:  # the check can fail: a wrong profile fails it on the same real run
        wrong = fidelity.load(_dump(_scaled(profile, factor), tmp_path / f"x{factor:.2f}.yaml"))
        wrong_median, wrong_worst = _score(fidelity.summarise(fidelity.simulate(wrong)), real)
        assert wrong_median > MEDIAN_LIMIT or wrong_worst > EACH_LIMIT, (factor, wrong_median)
        assert wrong_median >= MARGIN * median, (factor, wrong_median, median, report)


def _dump(profile: Profile, path: Path) -> Path:
    profile.dump(path)
    return path


def _scaled(profile: Profile, factor: float) -> Profile:
    step = StepModel(**{k: v * factor for k, v in profile.step_s.model_dump().items()})
    return profile.model_copy(update={"step_s": step, "frontend_s": profile.frontend_s * factor})


def _report(
    profile: Profile, hop: float, rows: list[tuple[str, float, float, float]], median: float,
    worst: float, spare: set[int], scheds: list[Sched], reals: list[dict[str, float]],
    drift: float,
) -> str:
    s = profile.step_s
    waits = ", ".join(f"{x.wait_share:.0%}" for x in scheds)
    lines = [
        fidelity.table(rows),
        "",
        f"median |error| {median:.1%}, worst but the p99s {worst:.1%} (limits "
        f"{MEDIAN_LIMIT:.0%} / {EACH_LIMIT:.0%})",
        f"profile (before and after pooled): step = {s.overhead * 1e3:.2f} ms + "
        f"{s.prefill_token * 1e6:.2f} us/prompt token (+ {s.mixed_prefill * 1e6:.2f} among "
        f"decodes) + {s.prefill_attn * 1e12:.2f} ps/attn + "
        f"{s.decode_seq * 1e6:.0f} us/decode + {s.decode_ctx * 1e9:.1f} ns/ctx token; frontend "
        f"{profile.frontend_s * 1e3:.2f} ms; fit median error "
        f"{profile.fit['median_abs_rel_error']:.1%}; gateway hop {hop * 1e3:.2f} ms "
        "(added to the frontend latency)",
        f"calibrations before and after the replay differ by {drift:.0%}",
        f"test client and gateway on CPUs {sorted(spare) or 'any'}; vLLM's threads waited for a "
        f"CPU {waits} of their run time (calibration, replay(s), calibration)",
    ]
    if len(reals) > 1:
        for key in reals[0]:
            values = [r[key] for r in reals]
            spread = (max(values) - min(values)) / statistics.median(values)
            lines.append(f"real runs {key}: {', '.join(f'{v:.4g}' for v in values)} "
                         f"(spread {spread:.0%})")
    return "\n".join(lines)
