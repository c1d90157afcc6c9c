"""Simulator fidelity: one workload, simulated with a measured profile and run for real.

`fidelity.yaml` describes the workload. `simulate` runs it in the simulator (the same Rust core
as the gateway, the engine model with the calibrated `FittedStepCost`) and `replay` sends the
very same requests (arrival times, prompt and output lengths) through the real gateway to real
vLLM. Both give one `Outcome` per request; `summarise` reduces them to the compared figures:

* TTFT p50 and p99 per class (from the request's arrival to its first token);
* ITL p50 per class: each request's mean time per token after the first, median over requests;
* throughput of the burst: its output tokens over the time from its first arrival to its last
  token (the engine's capacity; the steady class's throughput is just its offered load).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import numpy as np
import simpy
import yaml

from llmflow.sim.cluster import Cluster
from llmflow.sim.metrics import Recorder
from llmflow.sim.policies import DirectPolicy, GatedPolicy, policy_settings
from llmflow.sim.runner import arrivals
from llmflow.sim.scenario import Scenario, load_scenario
from llmflow.sim.workload import build_requests

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from llmflow.sim.sequence import StepRecord

__all__ = ["SCENARIO", "STARVED", "Outcome", "compare", "load", "replay", "simulate",
           "simulate_with_engine", "summarise"]

SCENARIO = Path(__file__).resolve().parent / "fidelity.yaml"
STARVED = Path(__file__).resolve().parent / "kv_starved.yaml"  # direct to a KV-starved vLLM
POLICY = "gateway"
_TOKEN_IDS = (100, 4000)  # random prompt ids, as `llmflow calibrate` draws them
_OPEN_AHEAD_S = 0.3  # connect this long before a request is due (keep-alive lasts 5 s)


@dataclass(frozen=True)
class Outcome:
    """One request as its client saw it (times in seconds from the run's start)."""

    cls: str
    arrival: float  # sent
    first: float  # first token; NaN when none came
    end: float  # last token
    tokens: int
    status: str  # completed, or what went wrong

    @property
    def ttft(self) -> float:
        """Seconds from sending to the first token."""
        return self.first - self.arrival

    @property
    def itl(self) -> float:
        """Mean seconds per token after the first (NaN with fewer than two tokens)."""
        if self.tokens < 2:
            return math.nan
        return (self.end - self.first) / (self.tokens - 1)


def load(profile: Path, scenario: Path = SCENARIO) -> Scenario:
    """A fidelity scenario with its backend's profile set to `profile`."""
    data = yaml.safe_load(scenario.read_text(encoding="utf-8"))
    data["cluster"][0]["profile"] = str(profile)
    tmp = profile.parent / "fidelity-scenario.yaml"
    tmp.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return load_scenario(tmp)


def gateway_sections(sc: Scenario) -> dict[str, Any]:
    """The llmflow config sections the real gateway runs with (the policy's `config`)."""
    return dict(sc.policies[POLICY].config)


def simulate(sc: Scenario) -> list[Outcome]:
    """Run the workload in the simulator (until every request has ended)."""
    return simulate_with_engine(sc)[0]


def simulate_with_engine(
    sc: Scenario, step_log: list[StepRecord] | None = None
) -> tuple[list[Outcome], Cluster]:
    """`simulate`, also giving the simulated cluster (its engines' counters), and filling
    `step_log` with the first backend's engine steps. The scenario's one policy is `gateway`
    (gated, through the core) or `direct` (straight to vLLM)."""
    reqs = build_requests(sc)
    env = simpy.Environment()
    name = POLICY if POLICY in sc.policies else "direct"
    spec = sc.policies[name]
    cluster = Cluster(env, sc.cluster, spec.scheduling_policy, spec.engine)
    if step_log is not None:
        cluster.backends[0].core.step_log = step_log
    gw: GatedPolicy | DirectPolicy
    if spec.kind == "direct":
        gw = DirectPolicy(env, cluster, spec.propagate_disconnect)
    else:
        gw = GatedPolicy(env, cluster, policy_settings(name, spec, sc, cluster))
    rec = Recorder(env)
    env.process(arrivals(env, reqs, sc, gw, rec, sc.seed))
    env.run(until=sc.horizon_s)
    return _outcomes(sc, rec), cluster


def _outcomes(sc: Scenario, rec: Recorder) -> list[Outcome]:
    cols = rec.columns()
    names = [wc.name for wc in sc.workload]
    return [
        Outcome(names[int(c)], t0, t0 + ttft, t0 + e2e, int(n), str(s))
        for c, t0, ttft, e2e, n, s in zip(cols["cls"], cols["t0"], cols["ttft"], cols["e2e"],
                                          cols["tokens"], cols["state"], strict=True)
    ]


async def replay(
    sc: Scenario, base_url: str, model: str = "tiny", seed: int | None = None
) -> list[Outcome]:
    """Send the workload's requests at their arrival times through `base_url` (the gateway).

    `seed` draws another set of arrival times and lengths from the same workload (a warm-up);
    the default is the scenario's, the requests `simulate` runs.

    Each request has its own connection, opened `_OPEN_AHEAD_S` before it is due, and a lean
    HTTP/1.1 reader: on two shared cores `httpx` setting up 40 connections at once costs the
    client hundreds of milliseconds, which would be timed as the system's TTFT.
    """
    reqs = build_requests(sc, seed)
    rng = random.Random()  # fresh prompts each replay: vLLM's prefix cache must never hit
    prompts = [[rng.randrange(*_TOKEN_IDS) for _ in range(int(n))] for n in reqs.prompt]
    split = urlsplit(base_url)
    start = time.perf_counter() + _OPEN_AHEAD_S + 0.2
    jobs = [
        _one((split.hostname or "127.0.0.1", split.port or 80), model,
             sc.workload[int(reqs.cls[i])].name, start, float(reqs.t[i]), prompts[i],
             int(reqs.max_tokens[i]))
        for i in range(len(reqs))
    ]
    return list(await asyncio.gather(*jobs))


async def _one(
    addr: tuple[str, int], model: str, cls: str, start: float, at: float, prompt: list[int],
    max_tokens: int,
) -> Outcome:
    await asyncio.sleep(max(0.0, start + at - _OPEN_AHEAD_S - time.perf_counter()))
    reader, writer = await asyncio.open_connection(*addr)
    payload = json.dumps({
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
               f"application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload
    try:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        sent = time.perf_counter()
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status != 200:
            return Outcome(cls, sent - start, math.nan, time.perf_counter() - start, 0,
                           f"http {status}")
        first, last, tokens = math.nan, math.nan, 0
        async for now, chunk in _events(reader):
            if chunk.get("choices"):  # a token (its text may be empty: a partial character)
                last = now - start
                if math.isnan(first):
                    first = last
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    finally:
        writer.close()
    status_text = "completed" if tokens == max_tokens else f"short ({tokens}/{max_tokens})"
    return Outcome(cls, sent - start, first, last, tokens, status_text)


async def _events(reader: asyncio.StreamReader) -> AsyncIterator[tuple[float, dict[str, Any]]]:
    """The SSE events of a chunked response, each with the time its bytes arrived."""
    buffer = b""
    while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
        buffer += (await reader.readexactly(size + 2))[:-2]
        now = time.perf_counter()
        while (end := buffer.find(b"\n\n")) >= 0:
            event, buffer = buffer[:end], buffer[end + 2:]
            if event.startswith(b"data: {"):
                yield now, json.loads(event[6:])


def summarise(outcomes: list[Outcome]) -> dict[str, float]:
    """The compared figures (see the module docstring), keyed `class.metric`."""
    out: dict[str, float] = {}
    for cls in sorted({o.cls for o in outcomes}):
        mine = [o for o in outcomes if o.cls == cls and o.status == "completed"]
        ttft = np.array([o.ttft for o in mine])
        out[f"{cls}.ttft_p50_s"] = float(np.percentile(ttft, 50))
        out[f"{cls}.ttft_p99_s"] = float(np.percentile(ttft, 99))
        out[f"{cls}.itl_p50_s"] = float(np.nanmedian([o.itl for o in mine]))
    burst = [o for o in outcomes if o.cls == "burst" and o.status == "completed"]
    if burst:
        span = max(o.end for o in burst) - min(o.arrival for o in burst)
        out["burst.throughput_tok_s"] = sum(o.tokens for o in burst) / span
    return out


def compare(sim: dict[str, float], real: dict[str, float]) -> list[tuple[str, float, float, float]]:
    """(metric, simulated, real, error) for every shared metric; the error is the log ratio
    `ln(sim / real)`: symmetric (twice and half as large are equally wrong, where
    `(sim - real) / real` can never go below -100%), and signed (> 0: the simulator is slow)."""
    return [(k, sim[k], real[k], math.log(sim[k] / real[k])) for k in real if k in sim]


def table(rows: list[tuple[str, float, float, float]]) -> str:
    """A Markdown table of `compare`'s rows (times in ms; the error as a log ratio and as the
    factor the simulator is off by)."""
    lines = ["| metric | simulated | real | ln(sim/real) | sim/real |", "|---|---|---|---|---|"]
    for name, sim, real, err in rows:
        scale, unit = ((1.0, " tok/s") if name.endswith("tok_s") else
                       (1e3, " ms") if name.endswith("_s") else (1.0, ""))  # else a count
        lines.append(f"| {name} | {sim * scale:.1f}{unit} | {real * scale:.1f}{unit} "
                     f"| {err:+.3f} | x{math.exp(err):.2f} |")
    return "\n".join(lines)
