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
import math
import os
import random
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from llmflow.calibrate import Calibration, calibrate, stream_request
from llmflow.gateway.http1 import ConnectionPool
from llmflow.sim.profile import Profile, StepModel, pooled
from tests.integration import fidelity
from tests.integration.cpu import Sched, SchedClock, pinned, spare_cpus
from tests.integration.gateway_server import GatewayProcess, gateway_config
from tests.integration.gwtools import wait_vllm_idle

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from llmflow.sim.scenario import Scenario
    from tests.integration.vllm_server import VllmServer

pytestmark = pytest.mark.integration

# vLLM's limits that /metrics does not publish: --max-num-seqs from DEFAULT_ARGS, and the CPU
# build's default --max-num-batched-tokens for the API server (vllm/engine/arg_utils.py).
ENGINE = {"max_num_seqs": 16, "max_num_batched_tokens": 2048}
# lean (two calibrations per run), but three contexts: the per-sequence and per-context decode
# costs are only told apart by batches that vary in both (docs/fidelity.md, "Fitting the step
# costs")
SWEEP = {"concurrency": (1, 4, 8, 16), "contexts": (32, 512, 1024)}
# Errors are log ratios, ln(sim / real) (`fidelity.compare`): symmetric, so a simulator that is
# twice too fast fails as surely as one twice too slow. Gross bounds only: on 2 shared cores the
# same real workload varies 20-49% run to run (see docs/fidelity.md), so the 15% target
# (|ln| <= 0.14) is reported, not asserted. What is asserted robustly is discrimination: the
# calibrated profile must beat deliberately wrong ones by a wide margin.
MEDIAN_LIMIT = math.log(1.6)  # median |ln(sim/real)| over the seven figures
EACH_LIMIT = math.log(2.0)  # every figure but the p99s within a factor of 2
P99_LIMIT = math.log(2.5)  # the p99s, CPU stalls and all (measured as low as x0.44)
MARGIN = 2.0  # a wrong profile's median error must be at least this many times the calibrated
WRONG = (3.0, 1 / 3)  # profiles with every cost scaled so must fail the same check
HOP_PAIRS = 12  # idle requests timed direct and through the gateway, alternately


def _score(sim: dict[str, float], real: dict[str, float]) -> tuple[float, float, float]:
    """(median |error| over every figure, worst |error| over the figures but the p99s, worst
    |error| of the p99s)."""
    rows = fidelity.compare(sim, real)
    errors = [abs(err) for *_, err in rows]
    bounded = [abs(err) for name, *_, err in rows if "p99" not in name]
    p99s = [abs(err) for name, *_, err in rows if "p99" in name]
    return statistics.median(errors), max(bounded), max(p99s)


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
@pytest.mark.xfail(
    strict=False,
    reason="issue 13, open: with the symmetric error ln(sim/real) the simulator under-predicts "
    "the steady class's TTFT through the gateway (p50 x0.47-0.8, p99 x0.11-0.35 in 4 of 5 runs "
    "on 2 shared cores, where vLLM's threads wait for a CPU 50-69% of the time); the old "
    "(sim - real) / real could not go below -100% and hid it. The report is still printed.",
)
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
    median, worst, worst_p99 = _score(sim, real)
    report = _report(vllm_profile, hop, fidelity.compare(sim, real), (median, worst, worst_p99),
                     spare, scheds, reals, _drift(before, after))
    print("\n" + report)
    if out := os.environ.get("LLMFLOW_FIDELITY_OUT"):
        Path(out).write_text(report + "\n", encoding="utf-8")
    assert median <= MEDIAN_LIMIT, report
    assert worst <= EACH_LIMIT, report
    assert worst_p99 <= P99_LIMIT, report
    for factor in WRONG:  # the check can fail: a wrong profile fails it on the same real run
        wrong = fidelity.load(_dump(_scaled(profile, factor), tmp_path / f"x{factor:.2f}.yaml"))
        wrong_median, wrong_worst, wrong_p99 = _score(
            fidelity.summarise(fidelity.simulate(wrong)), real)
        assert (wrong_median > MEDIAN_LIMIT or wrong_worst > EACH_LIMIT
                or wrong_p99 > P99_LIMIT), (factor, wrong_median)
        assert wrong_median >= MARGIN * median, (factor, wrong_median, median, report)


def _dump(profile: Profile, path: Path) -> Path:
    profile.dump(path)
    return path


def _scaled(profile: Profile, factor: float) -> Profile:
    step = StepModel(**{k: v * factor for k, v in profile.step_s.model_dump().items()})
    return profile.model_copy(update={"step_s": step, "frontend_s": profile.frontend_s * factor})


def _report(
    profile: Profile, hop: float, rows: list[tuple[str, float, float, float]],
    scores: tuple[float, float, float], spare: set[int], scheds: list[Sched],
    reals: list[dict[str, float]], drift: float,
) -> str:
    median, worst, worst_p99 = scores
    s = profile.step_s
    waits = ", ".join(f"{x.wait_share:.0%}" for x in scheds)
    lines = [
        fidelity.table(rows),
        "",
        f"median |ln(sim/real)| {median:.3f}, worst but the p99s {worst:.3f}, worst p99 "
        f"{worst_p99:.3f} (limits {MEDIAN_LIMIT:.3f} / {EACH_LIMIT:.3f} / {P99_LIMIT:.3f})",
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


# KV starvation: a vLLM whose cache holds 4,096 of the tiny model's tokens (1 KiB each), a burst
# that needs several times that. The goals: preemptions within 25% (reported; asserted
# within 50%, see below), TTFT p50/p99 within 15% (reported; asserted within the gross bound of
# the test above: on 2 shared cores the first run missed the target at x1.25 on TTFT p50 with a
# load average of 6).
STARVED_ARGS = ("--kv-cache-memory-bytes", str(4 << 20))
# The probes cover the shapes the burst runs (docs/fidelity.md, "Fitting the step costs"): first
# tokens up to 1,536 (the quadratic attention term shows only at long prompts), decodes at
# 32-896 tokens of context with every batch size that fits the 31 usable blocks (the burst
# decodes at 150-900), prompts of 128-768 joining a decoding batch (the burst's are 150-600, and
# a preempted one recomputes up to 900), each repeated and combined by its median. With decodes
# at (32, 256) and one mixed size the fit once set the context term to 0, and `mixed_prefill`
# rested on one noisy step.
STARVED_SWEEP = {"prompt_lengths": (16, 128, 256, 512, 768, 1024, 1536), "repeats": 5,
                 "concurrency": (1, 2, 4, 8, 16), "contexts": (32, 320, 640, 896),
                 "decode_repeats": 3, "mixed_prompts": (128, 384, 768)}
# Issue 30, open: with the staged fit's stable calibration the simulator under-predicts the
# starved burst's TTFT p50 by x0.53-0.54 (two recordings, 6 replays each): 0.56-0.63 beyond
# three replays' range in 3 of 4 triples, past the ln 1.6 bound. Traced inside vLLM
# (step_costs.py), the scheduling is vLLM's step for step; the TTFT magnifies a step-time error
# 1.2-2.4 times, and on 2 cores a step's time holds the engine core's wait for the core it
# shares with the API server and the client, which differs between calibration and burst
# (docs/fidelity.md). Earlier, unstable fits passed by putting more cost on mixed_prefill or
# prefill_attn.
STARVED_GAP = "issue 30, open: the starved burst's TTFT p50 is under-predicted (docs/fidelity.md)"


def starved_profile(server: VllmServer, sc: Scenario, **sweep: Any) -> Profile:
    """The starved protocol's calibration: warm the server up with another draw of the
    workload (a long-running server is warm), wait for it to idle, and calibrate it with
    `STARVED_SWEEP` (`sweep` overrides some of it). Run inside `pinned(spare_cpus(...))`."""
    asyncio.run(fidelity.replay(sc, server.url, seed=sc.seed + 1))  # warm-up
    wait_vllm_idle(server)
    cal = Calibration(server.url, engine=dict(ENGINE),
                      **dict(STARVED_SWEEP, **sweep))  # type: ignore[arg-type]
    return asyncio.run(calibrate(cal))
# The goal is within 25% (reported). Asserted: within 50%. The simulated count moves
# with the calibrated profile (13 to 18 against a real 14-16 in six runs on 2 shared cores).
PREEMPTION_TARGET = math.log(1.25)
PREEMPTION_LIMIT = math.log(1.5)
STARVED_REPLAYS = 3
# TTFT: the goal is within 15% (reported). Asserted as in the test above: the p50 within
# MEDIAN_LIMIT, the p99 (the slowest one of 36 requests) within P99_LIMIT, and profiles with
# every cost tripled or divided by three must miss the p50 bound on the same real runs. On 2
# shared cores the simulator under-predicts both by x0.6-0.7 (seven runs; docs/fidelity.md).
STARVED_TTFT_TARGET = math.log(1.15)  # reported
P50, P99 = "starved.ttft_p50_s", "starved.ttft_p99_s"


def _beyond_spread(sim: float, reals: Sequence[float]) -> float:
    """How far (|ln|) the simulated figure lies outside the band the real replays themselves
    span: 0 inside [min, max]. The issue's rule, "within the real system's own spread where that
    is wider": in one full-suite run the three replays' TTFT p50 were 0.82, 1.15 and 1.25 s (the
    host slowed while they ran), so the error against their median alone measured the host."""
    low, high = min(reals), max(reals)
    return max(0.0, math.log(low / sim), math.log(sim / high))


def _preemptions(server: VllmServer) -> float:
    return server.metrics().get("vllm:num_preemptions_total", 0.0)


@pytest.mark.timeout(600)  # about 100 s here with a vLLM start; twice that on a busy machine
def test_simulator_predicts_kv_starvation(
    vllm_server_factory: Callable[[Sequence[str]], VllmServer], tmp_path: Path
) -> None:
    """Calibrate a KV-starved vLLM (the probes are trimmed to fit its cache), replay a burst
    straight to it, and simulate the same burst with the profile: vLLM's own preemption
    counter and the clients' TTFT p50/p99 against the simulator's."""
    server = vllm_server_factory(STARVED_ARGS)
    assert server.process is not None
    sc = fidelity.load(tmp_path / "profile.yaml", fidelity.STARVED)
    with pinned(spare_cpus(server.process.pid)):
        profile = starved_profile(server, sc)
        # vLLM's preemption count and the clients' TTFT tail for the same burst vary run to run
        # on shared cores (12 to 18 preemptions in five runs; a p99 of 36 requests is their
        # slowest): each real figure compared is the median of three replays.
        counts, reals = [], []
        for _ in range(STARVED_REPLAYS):
            wait_vllm_idle(server)
            before = _preemptions(server)
            run = asyncio.run(fidelity.replay(sc, server.url))
            counts.append(_preemptions(server) - before)
            failed = [o for o in run if o.status != "completed"]
            assert not failed, failed[:5]
            reals.append(fidelity.summarise(run))
        real_preemptions = statistics.median(counts)
    profile.dump(tmp_path / "profile.yaml")
    sim_outcomes, cluster = fidelity.simulate_with_engine(sc)
    sim = fidelity.summarise(sim_outcomes)
    real = {key: statistics.median(r[key] for r in reals) for key in reals[0]}
    rows = [row for row in fidelity.compare(sim, real) if "ttft" in row[0]]
    rows.append(("preemptions", cluster.preemptions, real_preemptions,
                 math.log(max(cluster.preemptions, 1) / max(real_preemptions, 1))))
    report = "\n".join([
        fidelity.table(rows),
        f"num_gpu_blocks {profile.engine.get('num_gpu_blocks')}, block size "
        f"{profile.engine.get('block_size')}; prefix-cache hits on resume in the simulator: "
        f"{sum(b.core.cache_hit_tokens for b in cluster.backends)} tokens; real preemptions "
        f"per replay {counts}; real TTFT p50/p99 per replay "
        f"{', '.join(f'{r[P50]:.3f}/{r[P99]:.3f} s' for r in reals)}; preemptions target "
        f"|ln| <= {PREEMPTION_TARGET:.3f}, asserted "
        f"{PREEMPTION_LIMIT:.3f}; TTFT target "
        f"|ln| <= {STARVED_TTFT_TARGET:.3f}, asserted p50 {MEDIAN_LIMIT:.3f}, p99 {P99_LIMIT:.3f}",
    ])
    assert real_preemptions >= 10, report  # the workload does starve vLLM
    assert abs(rows[-1][3]) <= PREEMPTION_LIMIT, report
    # Each TTFT figure is checked against the band of the three replays, not their median alone
    # (see _beyond_spread); the wrong profiles must miss that same band.
    beyond = {key: _beyond_spread(sim[key], [r[key] for r in reals]) for key in (P50, P99)}
    report += f"\nbeyond the real spread: p50 {beyond[P50]:.3f}, p99 {beyond[P99]:.3f}"
    print("\n" + report)
    assert beyond[P99] <= P99_LIMIT, report
    if beyond[P50] > MEDIAN_LIMIT:
        # What holds is asserted above (the starvation, the preemptions, the p99); the p50 is
        # the known gap, and the wrong profiles below only mean something once it holds.
        pytest.xfail(f"{STARVED_GAP}\n{report}")
    for factor in WRONG:  # the check can fail: a wrong profile fails it on the same real runs
        wrong = fidelity.load(_dump(_scaled(profile, factor), tmp_path / f"x{factor:.2f}.yaml"),
                              fidelity.STARVED)
        wrong_p50 = fidelity.summarise(fidelity.simulate(wrong))[P50]
        err = _beyond_spread(wrong_p50, [r[P50] for r in reals])
        assert err > MEDIAN_LIMIT, (factor, err, report)
