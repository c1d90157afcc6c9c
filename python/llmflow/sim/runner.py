"""Running a scenario: one SimPy world per policy, the same requests for each, one report.

`run_scenario` builds the requests once from the seed, then for each policy builds a fresh
environment (backends, policy, arrival process, sampler), runs it until every request has ended
(or the horizon), and summarises. Same scenario and seed, same report, on any machine. With a
trace path, each gated policy's runtime records its events and actions (`trace_paths`), which
`llmflow trace replay` checks offline.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import simpy

from llmflow.sim.clients import RequestSpec, client
from llmflow.sim.cluster import Cluster
from llmflow.sim.disagg import PdProxy
from llmflow.sim.metrics import Recorder, class_summary, tpot
from llmflow.sim.policies import PRESETS, DirectPolicy, GatedPolicy, policy_settings
from llmflow.sim.replicas import ReplicatedPolicy
from llmflow.sim.report import dominance, verdicts
from llmflow.sim.workload import Requests, build_requests

if TYPE_CHECKING:
    from collections.abc import Callable, Generator
    from pathlib import Path
    from typing import TextIO

    from llmflow.sim.scenario import PolicySpec, Scenario

__all__ = ["PolicyRun", "arrivals", "run_policy", "run_scenario", "trace_paths"]


@dataclass
class PolicyRun:
    """What one policy's run produced: its report block and the raw series for plots."""

    name: str
    summary: dict[str, Any]
    series: dict[str, np.ndarray]  # t, queue, running, kv_usage
    ttft: dict[str, np.ndarray] = field(default_factory=dict)  # class -> TTFTs (s)
    trace: Path | None = None  # the runtime's JSONL trace, when recorded
    requests: list[tuple[Any, ...]] = field(default_factory=list)  # `request_log.COLUMNS` rows


def arrivals(
    env: simpy.Environment, reqs: Requests, sc: Scenario, gw: Any, rec: Recorder, seed: int,
    live: dict[int, tuple[int, float, RequestSpec]] | None = None,
) -> Generator[simpy.Event, None, None]:
    """The arrival process: a SimPy process that starts each request's client at its time.

    Request `i` is `RequestSpec` number `i` (its fingerprint, by which the runtime knows a
    retry, and its per-request row), with its prefix hashes; each workload class's clients
    draw their jitter from their own `random.Random(f"{seed}:{class}:client")`.

    Args:
        env: the environment.
        reqs: the requests (`build_requests`), in arrival order.
        sc: their scenario (the classes' tenants, prefixes and client behaviour).
        gw: what the clients send to (`clients.Gateway`).
        rec: records each request's end.
        seed: seeds the clients' jitter.
        live: filled with the requests started and not yet ended (index -> class, start,
            spec), for `Recorder.close`.
    """
    live = {} if live is None else live
    classes = sc.workload
    rngs = [random.Random(f"{seed}:{i}:client") for i in range(len(classes))]
    t, cls, prompt = reqs.t.tolist(), reqs.cls.tolist(), reqs.prompt.tolist()
    eos, max_tokens = reqs.eos.tolist(), reqs.max_tokens.tolist()
    hashes = reqs.hash_ids.tolist() if reqs.hash_ids is not None else [None] * len(t)
    for i in range(len(t)):
        delay = t[i] - env.now
        if delay > 0:
            yield env.timeout(delay)
        c = cls[i]
        wc = classes[c]
        block = wc.prefix.block_tokens if wc.prefix is not None else 512
        spec = RequestSpec(c, wc.tenant, prompt[i], eos[i], max_tokens[i], i, hashes[i], block)
        live[i] = (c, env.now, spec)
        proc = env.process(client(env, spec, gw, wc.client, rngs[c], rec))
        proc.callbacks.append(_forget(live, i))


def _forget(
    live: dict[int, tuple[int, float, RequestSpec]], i: int
) -> Callable[[simpy.Event], None]:
    def done(_ev: simpy.Event) -> None:
        live.pop(i, None)

    return done


def _sampler(
    env: simpy.Environment, cluster: Cluster, gw: Any, every: float, out: list[tuple[float, ...]]
) -> Generator[simpy.Event, None, None]:
    g = cluster.gauges
    slots = sum(b.core.config.max_num_seqs for b in cluster.backends)
    last_area, last_t = 0.0, env.now
    while True:
        queued = gw.runtime.queued if isinstance(gw, (GatedPolicy, ReplicatedPolicy)) else 0
        kv = g.used / g.total_blocks
        area = sum(b.budget_area for b in cluster.backends)
        dt = env.now - last_t
        compute = (area - last_area) / (dt * len(cluster.backends)) if dt else 0.0
        last_area, last_t = area, env.now
        # The engine is as busy as its binding resource: sequences, KV blocks, or the step's
        # token budget over the last interval (prefill-bound work). What a gated
        # policy keeps free on purpose is read only while work waits, the one time it matters:
        # the latency tiers' headroom slots, or the KV its running requests are expected to
        # grow into (the fit commits each request's expected peak at start).
        reserved = 0.0
        if queued + g.waiting and isinstance(gw, GatedPolicy):
            snap = gw.runtime.snapshot(round(env.now * 1e6))
            capacity = sum(b["kv_capacity_blocks"] for b in snap["backends"])
            committed = sum(b["kv_blocks_committed"] for b in snap["backends"])
            grow = committed / capacity - kv if capacity else 0.0
            reserved = max(snap["headroom_slots"] / slots, grow, 0.0)
        busy = min(1.0, max(g.running / slots, kv, compute))
        out.append((env.now, queued + g.waiting, g.running, kv, busy, reserved))
        yield env.timeout(every)


def occupancy_while_queued(samples: np.ndarray) -> dict[str, float | None]:
    """How busy the engines were while work waited (gateway queue or vLLM's own), and the
    share a policy kept free on purpose then: the "no idle GPU while work waits" check.

    Busy is the binding resource's use, whichever is fuller: running sequences over
    `max_num_seqs`, KV blocks in use, or the step token budget used since the last sample.
    Kept is the larger of the headroom slots and the KV committed to running requests'
    expected growth. Both are None when nothing ever waited."""
    # Work that waits across two samples in a row: a request waiting for the engine's next
    # step, seen at one sample, is the step boundary, not idle capacity.
    queued = samples[:, 1] > 0 if len(samples) else np.zeros(0, dtype=bool)
    waiting = queued & np.concatenate(([False], queued[:-1])) if len(queued) else queued
    if not waiting.any():
        return {"busy": None, "reserved": None, "waiting_share": 0.0}
    return {
        "busy": round(float(samples[waiting, 4].mean()), 4),
        "reserved": round(float(samples[waiting, 5].mean()), 4),
        "waiting_share": round(float(waiting.mean()), 4),
    }


def run_policy(
    sc: Scenario, name: str, spec: PolicySpec, reqs: Requests, seed: int,
    progress: Callable[[int], None] | None = None, trace: TextIO | None = None,
    on_cluster: Callable[[Cluster], None] | None = None,
) -> PolicyRun:
    """Simulate one policy on the given requests.

    Args:
        sc: the scenario.
        name: policy name (also picks the built-in preset for gated policies).
        spec: the policy's spec from the scenario.
        reqs: the requests (`build_requests`).
        seed: seeds the clients' jitter.
        progress: called with the number of requests ended since the last call.
        trace: where a gated policy writes its runtime's JSONL trace (ignored for `direct`).
        on_cluster: called with the simulated cluster before the run (to set step logs).
    """
    wall0 = time.perf_counter()
    env = simpy.Environment()
    sched = None if spec.kind == "direct" else (
        spec.scheduling_policy or PRESETS[spec.preset_for(name)][1])
    cluster = Cluster(env, spec.cluster or sc.cluster, sched, spec.engine)
    if on_cluster is not None:
        on_cluster(cluster)
    gw: DirectPolicy | GatedPolicy | ReplicatedPolicy | PdProxy
    if spec.kind == "direct" and cluster.disaggregated:
        gw = PdProxy(env, cluster, spec.propagate_disconnect)
    elif spec.kind == "direct":
        gw = DirectPolicy(env, cluster, spec.propagate_disconnect)
    else:
        settings = policy_settings(name, spec, sc, cluster)
        if spec.replicas is not None:
            gw = ReplicatedPolicy(env, cluster, settings, spec.replicas)
        else:
            gw = GatedPolicy(env, cluster, settings, trace)
    rec = Recorder(env)
    total = len(reqs)
    done = env.event()
    live: dict[int, tuple[int, float, RequestSpec]] = {}
    ended = [0, 0]  # ended so far, reported to progress so far

    def _on_end() -> None:
        ended[0] += 1
        if progress is not None and ended[0] - ended[1] >= 256:
            progress(ended[0] - ended[1])
            ended[1] = ended[0]
        if ended[0] == total and not done.triggered:
            done.succeed()

    rec.on_end.append(_on_end)
    env.process(arrivals(env, reqs, sc, gw, rec, seed, live))
    samples: list[tuple[float, ...]] = []
    env.process(_sampler(env, cluster, gw, sc.sample_interval_s, samples))
    if total:
        env.run(until=simpy.AnyOf(env, [done, env.timeout(sc.horizon_s)]))
    if isinstance(gw, (GatedPolicy, ReplicatedPolicy)):
        gw.flush_trace()
    rec.close(sorted(live.values(), key=lambda v: v[1]))
    if progress is not None and ended[0] > ended[1]:
        progress(ended[0] - ended[1])
    return _summarise(sc, name, env, cluster, gw, rec, samples, time.perf_counter() - wall0)


def _summarise(
    sc: Scenario, name: str, env: simpy.Environment, cluster: Cluster,
    gw: DirectPolicy | GatedPolicy | ReplicatedPolicy | PdProxy, rec: Recorder,
    samples: list[tuple[float, ...]], wall: float,
) -> PolicyRun:
    cols = rec.columns()
    horizon = env.now
    classes = {
        wc.name: class_summary(cols, i, wc.client.chars_per_token)
        for i, wc in enumerate(sc.workload)
    }
    g = cluster.gauges
    gate = gw if isinstance(gw, (GatedPolicy, ReplicatedPolicy)) else None
    gated = gate is not None
    peak_gw = gate.peak_queue if gate is not None else 0
    good = 0
    per_token = tpot(cols)
    for i, wc in enumerate(sc.workload):
        mine = (cols["cls"] == i) & (cols["state"] == "completed")
        if wc.slo is not None and wc.slo.ttft_p99_s is not None:
            mine &= cols["ttft"] <= wc.slo.ttft_p99_s
        if wc.slo is not None and wc.slo.e2e_p99_s is not None:
            mine &= cols["e2e"] <= wc.slo.e2e_p99_s
        if wc.slo is not None and wc.slo.tpot_p99_s is not None:  # one-token answers pass
            mine &= ~(per_token > wc.slo.tpot_p99_s)
        good += int(mine.sum())
        classes[wc.name]["within_slo"] = int(mine.sum())
    gen_tokens = sum(b.core.generation_tokens_total for b in cluster.backends)
    summary: dict[str, Any] = {
        "classes": classes,
        "peak_running": g.peak_running,
        "peak_queue": peak_gw if gated else g.peak_waiting,
        "peak_gateway_queue": peak_gw,
        "peak_engine_waiting": g.peak_waiting,
        "peak_kv_usage": round(g.peak_kv, 6),
        "preemptions": cluster.preemptions,
        # per second of the arrival window, the same for every policy: over a policy's own run
        # length, one that drops work would end sooner and look faster (brownout: direct
        # timed out 588 requests and ran 440 s against llmflow's 687 s)
        "goodput_rps": round(good / sc.duration_s, 6),
        "sim_s": round(horizon, 6),
        "engine_steps": cluster.steps,
        "generated_tokens": gen_tokens,
        "rejections": dict(sorted(gate.rejections.items())) if gate is not None else {},
        "browned_out": gate.browned_out if gate is not None else 0,
        "littles_law": rec.littles_law(horizon),
        "occupancy_while_queued": occupancy_while_queued(
            np.array(samples) if samples else np.zeros((0, 6))),
        "gpus": cluster.gpus,
        "wall_s": round(wall, 3),
    }
    if isinstance(gw, ReplicatedPolicy):
        summary["lease_denials"] = gw.lease_denials
    queried = sum(b.core.prefix_query_tokens for b in cluster.backends)
    if queried:  # requests carried block hashes: how routing used the engines' prefix caches
        summary["prefix"] = _prefix_summary(cluster, queried)
    arr = np.array(samples) if samples else np.zeros((0, 6))
    series = {"t": arr[:, 0], "queue": arr[:, 1], "running": arr[:, 2], "kv_usage": arr[:, 3]}
    ttft = {wc.name: cols["ttft"][cols["cls"] == i] for i, wc in enumerate(sc.workload)}
    names = [wc.name for wc in sc.workload]
    requests = [(r[0], names[r[1]], *r[2:]) for r in sorted(rec.requests, key=lambda r: r[0])]
    return PolicyRun(name, summary, series, ttft, requests=requests)


def _prefix_summary(cluster: Cluster, queried: int) -> dict[str, Any]:
    """Prefix-cache hit rate over all engines (hit prompt tokens over prompt tokens of requests
    with hash ids, vLLM's `prefix_cache_hits / prefix_cache_queries`) and the balance of
    requests over backends (the busiest one's count over the mean; 1.0 is even)."""
    hits = sum(b.core.prefix_hit_tokens for b in cluster.backends)
    added = [b.core.requests_added for b in cluster.backends]
    mean = sum(added) / len(added)
    return {
        "hit_rate": round(hits / queried, 6),
        "requests_per_backend": added,
        "imbalance": round(max(added) / mean, 6) if mean else 1.0,
    }


def trace_paths(path: Path, gated: list[str]) -> dict[str, Path]:
    """Where each gated policy's trace goes: `path` itself for one, else `-<policy>` inserted
    before the suffix (`run.jsonl` -> `run-llmflow.jsonl`). Per-request rows
    (`--requests-out`) are named the same way."""
    if len(gated) == 1:
        return {gated[0]: path}
    return {name: path.with_name(f"{path.stem}-{name}{path.suffix}") for name in gated}


def run_scenario(
    sc: Scenario, policies: list[str] | None = None, seed: int | None = None,
    progress: bool = False, trace: Path | None = None,
) -> tuple[dict[str, Any], list[PolicyRun]]:
    """Run the scenario's policies (all, or those named) on the same requests.

    Args:
        sc: the scenario.
        policies: the policies to run (default: all the scenario defines).
        seed: overrides the scenario's seed.
        progress: show a progress bar per policy.
        trace: record each gated policy's runtime trace here (see `trace_paths`).

    Returns:
        The report (`report.json`'s content) and the per-policy runs (for plots).

    Raises:
        KeyError: a policy name the scenario does not define.
    """
    seed = sc.seed if seed is None else seed
    names = policies or list(sc.policies)
    unknown = [n for n in names if n not in sc.policies]
    if unknown:
        raise KeyError(f"unknown policy {unknown}; the scenario defines {list(sc.policies)}")
    reqs = build_requests(sc, seed)
    gated = [n for n in names if sc.policies[n].kind == "gated"]
    paths = trace_paths(trace, gated) if trace is not None and gated else {}
    runs = []
    for name in names:
        bar = _bar(name, len(reqs)) if progress else None
        path = paths.get(name)
        out = path.open("w", encoding="utf-8") if path is not None else None
        try:
            run = run_policy(sc, name, sc.policies[name], reqs, seed,
                             bar.update if bar is not None else None, out)
            run.trace = path
            runs.append(run)
        finally:
            if out is not None:
                out.close()
            if bar is not None:
                bar.close()
    report = {
        "scenario": sc.title,
        "seed": seed,
        "requests": len(reqs),
        "policies": {r.name: r.summary for r in runs},
    }
    tpot_classes = [wc.name for wc in sc.workload
                    if wc.slo is not None and wc.slo.tpot_p99_s is not None]
    if tpot_classes:  # the per-token table, only where a class declares a TPOT SLO
        report["tpot_classes"] = tpot_classes
    verdicts(sc, report)
    dominance(sc, report)
    return report, runs


def _bar(name: str, total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=f"{name:>10}", unit="req", leave=True, dynamic_ncols=True)
