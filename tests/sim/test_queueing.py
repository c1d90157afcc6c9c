"""Queueing-theory checks: the engine as an M/M/c server matches Erlang C; Little's law holds."""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import simpy

from llmflow.sim.cluster import Backend, Gauges
from llmflow.sim.costmodel import FixedStepCost
from llmflow.sim.engine import EngineConfig, EngineCore, Seq

if TYPE_CHECKING:
    from collections.abc import Generator


def erlang_c_wait(c: int, lam: float, mu: float) -> float:
    """Mean wait in queue of M/M/c (Erlang C)."""
    a = lam / mu
    rho = a / c
    tail = a**c / math.factorial(c) / (1 - rho)
    p_wait = tail / (sum(a**k / math.factorial(k) for k in range(c)) + tail)
    return p_wait / (c * mu - lam)


def _mmc(env: simpy.Environment, log: Any, c: int, lam: float, mean_tokens: float, dt: float,
         n: int, seed: int) -> tuple[list[Seq], Gauges]:
    core = EngineCore(EngineConfig(max_num_seqs=c, max_num_batched_tokens=max(c, 16),
                                   max_model_len=100_000, num_gpu_blocks=10**7), FixedStepCost(dt))
    gauges = Gauges(env, core.num_blocks)
    backend = Backend(env, "b", core, gauges)
    rng = random.Random(seed)
    seqs: list[Seq] = []

    def arrivals() -> Generator[simpy.Event, None, None]:
        for i in range(n):
            yield env.timeout(rng.expovariate(lam))
            tokens = max(1, math.ceil(rng.expovariate(1 / mean_tokens)))
            seq = Seq(i, 1, tokens, owner=log)
            seqs.append(seq)
            backend.submit(seq)

    env.process(arrivals())
    env.run()
    return seqs, gauges


@pytest.mark.slow
def test_mmc_mean_wait_matches_erlang_c(log: Any) -> None:
    # One token per 20 ms step, geometric lengths of mean 25 tokens: service of mean ~0.5 s;
    # the batch never slows down, so each of the c = 4 sequence slots is a server (rho = 0.75).
    # The mean wait of M/M/c at this load is noisy, so 5 seeds x 60k requests are pooled.
    # Allen-Cunneen's (1 + Cs^2) / 2 factor accounts for the geometric service's Cs^2 of 0.96.
    c, lam, dt, mean_tokens = 4, 6.0, 0.02, 25.0
    waits, expected = [], []
    for seed in range(1, 6):
        seqs, _ = _mmc(simpy.Environment(), log, c, lam, mean_tokens, dt, n=60_000, seed=seed)
        service = np.array([s.stop * dt for s in seqs])
        cs2 = float(service.var() / service.mean() ** 2)
        expected.append(erlang_c_wait(c, lam, 1 / float(service.mean())) * (1 + cs2) / 2)
        waits.append(float(np.mean([s.t_sched - s.arrival for s in seqs])))
    measured, want = float(np.mean(waits)), float(np.mean(expected))
    assert abs(measured - want) / want < 0.05, (waits, expected)


def test_littles_law_in_the_engine(env: simpy.Environment, log: Any) -> None:
    # L from the gauges' time integral of running + waiting, W from each request's own times:
    # two bookkeeping paths that agree only if every request is counted in and out once.
    seqs, gauges = _mmc(env, log, 4, 3.0, 50.0, 0.01, n=3000, seed=5)
    horizon = env.now
    big_l = (gauges.area_running + gauges.area_waiting) / horizon
    sojourn = np.array([log.ended[s.rid][0] - s.arrival for s in seqs])
    assert len(log.ended) == len(seqs)
    assert big_l == pytest.approx(len(seqs) / horizon * sojourn.mean(), rel=1e-9)
