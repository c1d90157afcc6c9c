"""P/D disaggregation: the KV link's timing, decode admission by blocks, nothing lost, and the
core's own choice of both instances (a gated policy on a split cluster)."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import simpy

from llmflow.config import load_settings
from llmflow.sim.clients import RequestSpec, client
from llmflow.sim.cluster import Cluster
from llmflow.sim.costmodel import cost_model
from llmflow.sim.disagg import Hop, PdProxy
from llmflow.sim.metrics import Recorder, tpot
from llmflow.sim.policies import GatedPolicy
from llmflow.sim.scenario import BackendGroup, ClientSpec, ScenarioError, load_scenario
from llmflow.sim.sequence import DECODE, LOADING, STATE_NAMES

from .invariants import check_engine

if TYPE_CHECKING:
    from pathlib import Path

H100_8B = {"gpu": "h100", "model": "llama-3-8b"}


def _groups(p: int, d: int, bw: float, lat_ms: float, **decode: Any) -> list[BackendGroup]:
    return [
        BackendGroup(name="p", count=p, role="prefill", **H100_8B),
        BackendGroup(
            name="d",
            count=d,
            role="decode",
            **H100_8B,
            link={"bandwidth_gb_s": bw, "latency_ms": lat_ms},
            **decode,
        ),
    ]


def _serve(
    groups: list[BackendGroup],
    reqs: list[tuple[float, int, int]],
    spec: ClientSpec | None = None,
    watch: Any = None,
) -> tuple[Cluster, Recorder]:
    """Run (arrival s, prompt, output) requests through the P/D proxy until all have ended."""
    env = simpy.Environment()
    cluster = Cluster(env, groups, None)
    proxy = PdProxy(env, cluster)
    return cluster, _drive(env, cluster, proxy, reqs, spec, watch)


def _drive(
    env: simpy.Environment,
    cluster: Cluster,
    policy: Any,
    reqs: list[tuple[float, int, int]],
    spec: ClientSpec | None,
    watch: Any,
) -> Recorder:
    """Send (arrival s, prompt, output) requests to `policy`, each from a client of its own,
    and run until all have ended (600 simulated s at most)."""
    rec = Recorder(env)
    rng = random.Random(0)

    def arrivals() -> Any:
        for i, (t, prompt, out) in enumerate(reqs):
            yield env.timeout(max(0.0, t - env.now))
            req = RequestSpec(0, "t", prompt, out, out, i)
            env.process(client(env, req, policy, spec or ClientSpec(), rng, rec))

    env.process(arrivals())
    if watch is not None:
        env.process(watch(env, cluster))
    env.run(until=600)
    return rec


def _step(prefill: int, done: int = 0) -> float:
    """The roofline step time of one request's chunk alone (as the engine costs it)."""
    c = cost_model("h100", "llama-3-8b")
    return c.step_time(0, 0, prefill, prefill * (2 * done + prefill), done + prefill, 0.0)


@pytest.mark.parametrize(("bw", "lat_ms"), [(1.0, 0.0), (10.0, 2.0), (100.0, 0.5)])
def test_transfer_takes_kv_bytes_over_bandwidth_plus_latency(bw: float, lat_ms: float) -> None:
    # one request on an idle split: its first token comes from the decode instance after the
    # prefill's step, the transfer, and the decode's one-token step (the last prompt token)
    prompt = 3000
    _, rec = _serve(_groups(1, 1, bw, lat_ms), [(0.0, prompt, 20)])
    ttft = rec.rows[0][2]
    kv_bytes = prompt * cost_model("h100", "llama-3-8b").kv_bytes_per_token
    transfer = kv_bytes / (bw * 1e9) + lat_ms / 1000
    assert ttft == pytest.approx(_step(prompt) + transfer + _step(1, prompt - 1), abs=1e-9)


def test_a_link_carries_one_transfer_at_a_time() -> None:
    # two prompts prefilled in the same step go to the one decode instance over one slow link:
    # the second lands one wire time after the first (FIFO), its first token within a step
    prompt, bw = 2000, 1.0
    _, rec = _serve(_groups(1, 1, bw, 0.0), [(0.0, prompt, 50), (0.0, prompt, 50)])
    t1, t2 = sorted(r[2] for r in rec.rows)
    wire = prompt * cost_model("h100", "llama-3-8b").kv_bytes_per_token / (bw * 1e9)
    assert abs((t2 - t1) - wire) <= _step(1, prompt) + 1e-9


def _recount(core: Any) -> int:
    """KV blocks held, recounted from the engine's sequences (exact mid-step too: the step in
    progress holds its chunks' blocks and each decoder's slot for the token it computes)."""
    bs, s, inside = core.block_size, core.step, core.in_step
    running = sum(
        -(-(q.k + s + inside) // bs) if q.state == DECODE else q.blocks
        for q in core.running.values()
    )
    chunks = sum(nb for _, _, nb in core._chunks) if inside else 0
    loading = sum(q.blocks for q in core.loading.values() if q.state == LOADING)
    return running + chunks + loading + sum(q.blocks for q in core.kv_held.values())


def test_decode_pool_never_exceeds_its_blocks_and_loses_nothing() -> None:
    # 40 prompts of 2,000 tokens (125 blocks each) into two decode instances of 400 blocks: at
    # most three fit in each at once, the rest wait in the decode engines' queues for blocks
    seen = {"peak": 0, "waited": 0}

    def watch(env: simpy.Environment, cluster: Cluster) -> Any:
        while True:
            for b in cluster.backends:
                held = _recount(b.core)
                assert held == b.core.used
                assert held <= b.core.num_blocks
                if b.role == "decode":
                    seen["peak"] = max(seen["peak"], held)
                    seen["waited"] = max(seen["waited"], b.core.n_waiting)
            yield env.timeout(0.002)

    reqs = [(0.01 * i, 2000, 100) for i in range(40)]
    cluster, rec = _serve(
        _groups(1, 2, 50.0, 1.0, engine={"num_gpu_blocks": 400, "max_model_len": 4096}),
        reqs,
        watch=watch,
    )
    assert seen["waited"] > 0  # blocks were short: requests did wait for them
    assert seen["peak"] > 250  # and the pool filled up to what fits
    assert [r[4] for r in rec.rows] == ["completed"] * 40
    assert all(r[7] == 100 for r in rec.rows)  # every output token came
    for b in cluster.backends:  # the prefill side freed every block once its KV was read
        check_engine(b.core)
        assert _recount(b.core) == 0
        assert b.core.free_q.free == b.core.num_blocks


@pytest.mark.parametrize(("bw", "blocks", "timeout_s"), [(2.0, 600, 0.4), (5.0, 400, 1.0)])
def test_clients_that_leave_mid_way_leave_no_blocks_behind(
    bw: float, blocks: int, timeout_s: float
) -> None:
    # timeouts fire while requests wait for or run their prefill, wait for decode blocks or
    # are in transfer (the first case aborts transfers, the second requests waiting for decode
    # blocks, and preempts a decode that got its KV from the prefill: it recomputes locally)
    reqs = [(0.005 * i, 1500 + 37 * i, 200) for i in range(60)]
    spec = ClientSpec(timeout_s=timeout_s)

    def watch(env: simpy.Environment, cluster: Cluster) -> Any:
        while True:  # every abort gives its blocks back at once, on both sides
            for b in cluster.backends:
                assert _recount(b.core) == b.core.used <= b.core.num_blocks
            yield env.timeout(0.001)

    groups = _groups(1, 1, bw, 5.0, engine={"num_gpu_blocks": blocks, "max_model_len": 4096})
    cluster, rec = _serve(groups, reqs, spec, watch)
    states = [r[4] for r in rec.rows]
    assert len(states) == 60
    assert "timed_out" in states
    assert "completed" in states
    for b in cluster.backends:
        check_engine(b.core)
        assert _recount(b.core) == 0
        assert not b.core.loading
        assert not b.core.kv_held
        assert b.core.free_q.free == b.core.num_blocks


SLOTS = 4  # the gate's slots per instance (one GPU each)


def _gated(
    groups: list[BackendGroup],
    reqs: list[tuple[float, int, int]],
    spec: ClientSpec | None = None,
    watch: Any = None,
    signals: bool = True,
) -> tuple[Cluster, GatedPolicy, Recorder, list[tuple[str, str, int]]]:
    """Run the requests through the core on a split cluster; also returns what each engine was
    sent: (backend, role, request id), counted at the engines' door. `signals`: whether the core
    hears the clients' timeouts (their deadlines) and retry counts."""
    env = simpy.Environment()
    cluster = Cluster(env, groups, "priority")
    sent: list[tuple[str, str, int]] = []
    for b in cluster.backends:
        add = b.core.add

        def counted(seq: Any, now: float, b: Any = b, add: Any = add) -> None:
            sent.append((b.name, b.role, seq.rid))
            add(seq, now)

        b.core.add = counted  # type: ignore[method-assign]
    backends = [
        {"name": b.name, "role": b.role, "kv_blocks": b.core.num_blocks,
         "max_model_len": b.core.config.max_model_len, "scheduling_policy": "priority"}
        for b in cluster.backends
    ]
    settings = load_settings(data={
        "backends": backends, "gate": {"max_concurrency_per_gpu": SLOTS},
        "tiers": [{"name": "t"}], "default_tier": "t", "tenants": [{"name": "t", "tier": "t"}],
        "signals": {"retry_headers": signals, "deadline_headers": signals}})
    gw = GatedPolicy(env, cluster, settings)
    return cluster, gw, _drive(env, cluster, gw, reqs, spec, watch), sent


def _no_leak(cluster: Cluster, gw: GatedPolicy) -> None:
    for b in cluster.backends:  # every block back on both sides, nothing half-way
        check_engine(b.core)
        assert _recount(b.core) == 0
        assert not b.core.loading
        assert not b.core.kv_held
        assert b.core.free_q.free == b.core.num_blocks
    assert gw.runtime.live == 0
    snap = gw.runtime.snapshot(round(cluster.backends[0].env.now * 1e6))
    assert [b["running"] for b in snap["backends"]] == [0] * len(cluster.backends)


def test_the_core_runs_each_prompt_on_a_prefill_then_a_decode_instance_within_its_slots() -> None:
    # 60 prompts at once into 2 prefill + 2 decode instances of 4 slots each: each engine sees
    # at most 4 of them at a time (a decode's slot is held from the start, its prefill's until
    # the prefill answers), each request prefills on a prefill instance (one token, its KV
    # kept) and decodes on a decode instance (its KV read), and every prefill's blocks are
    # freed once read
    peak: dict[str, int] = {}

    def watch(env: simpy.Environment, cluster: Cluster) -> Any:
        while True:
            for b in cluster.backends:
                c = b.core
                peak[b.name] = max(peak.get(b.name, 0), c.num_running + c.num_waiting)
            yield env.timeout(0.001)

    reqs = [(0.0, 1000 + 50 * i, 30) for i in range(60)]
    cluster, gw, rec, sent = _gated(_groups(2, 2, 50.0, 1.0), reqs, watch=watch)
    assert [r[4] for r in rec.rows] == ["completed"] * 60
    assert all(r[7] == 30 for r in rec.rows)  # every output token came
    assert max(peak.values()) == SLOTS  # the cap was reached, never passed
    by_role = {"prefill": [], "decode": []}  # type: dict[str, list[int]]
    for _, role, rid in sent:
        by_role[role].append(rid)
    # each served attempt once on each side (a refused one is retried under a new id)
    assert sorted(by_role["prefill"]) == sorted(by_role["decode"])
    assert len(set(by_role["prefill"])) == len(by_role["prefill"]) == 60
    assert {name for name, _, _ in sent} == {"p-0", "p-1", "d-0", "d-1"}  # all four used
    _no_leak(cluster, gw)


@pytest.mark.parametrize(("bw", "timeout_s"), [(1.0, 0.3), (5.0, 0.2)])
def test_a_client_that_leaves_during_the_prefill_or_the_transfer_frees_both_sides(
    bw: float, timeout_s: float
) -> None:
    # timeouts fire while requests wait in the gateway, prefill, or move their KV over a slow
    # link: each abort gives every block back at once, on both sides, and frees its slots. The
    # core does not hear the clients' deadlines here: told them, it refuses at arrival the
    # requests whose clients would leave before they start (tests/sim/test_policies.py), and
    # fewer are then left to leave mid-prefill, which is the path this test walks
    reqs = [(0.005 * i, 1500 + 37 * i, 200) for i in range(60)]
    where: list[str] = []

    def watch(env: simpy.Environment, cluster: Cluster) -> Any:
        while True:
            for b in cluster.backends:
                assert _recount(b.core) == b.core.used <= b.core.num_blocks
            yield env.timeout(0.001)

    def note(gw: GatedPolicy) -> None:
        cancel = gw.cancel

        def noted(att: Any) -> None:
            hop = att.handler
            if isinstance(hop, Hop):
                where.append("prefill" if hop.dseq is None else STATE_NAMES[hop.dseq.state])
            cancel(att)

        gw.cancel = noted  # type: ignore[method-assign]

    groups = _groups(1, 1, bw, 5.0, engine={"num_gpu_blocks": 600, "max_model_len": 4096})
    spec = ClientSpec(timeout_s=timeout_s)
    orig = GatedPolicy.__init__

    def init(self: GatedPolicy, *a: Any, **k: Any) -> None:
        orig(self, *a, **k)
        note(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GatedPolicy, "__init__", init)
        cluster, gw, rec, _ = _gated(groups, reqs, spec, watch, signals=False)
    states = [r[4] for r in rec.rows]
    assert len(states) == 60
    assert "timed_out" in states
    assert {"prefill", "loading"} <= set(where)  # left during the prefill and the transfer
    _no_leak(cluster, gw)


def _scenario_file(tmp_path: Path, cluster: str, policies: str) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(
        "title: x\nduration_s: 1\n"
        f"cluster:\n{cluster}"
        "workload:\n  - {name: c, tenant: t, arrival: {kind: burst, count: 1},\n"
        "     prompt_tokens: {kind: fixed, value: 10}, output_tokens: {kind: fixed, value: 2}}\n"
        f"policies:\n{policies}"
    )
    return path


SPLIT = (
    "  - {name: p, gpu: h100, model: llama-3-8b, role: prefill}\n"
    "  - {name: d, gpu: h100, model: llama-3-8b, role: decode,"
    " link: {bandwidth_gb_s: 50}}\n"
)


def test_a_gated_policy_may_run_a_split_cluster_but_not_its_replicas(tmp_path: Path) -> None:
    sc = load_scenario(_scenario_file(tmp_path, SPLIT, "  llmflow: {}\n"))
    assert sc.policies["llmflow"].cluster is None
    with pytest.raises(ScenarioError, match="lease covers one backend per request"):
        load_scenario(_scenario_file(tmp_path, SPLIT, "  llmflow: {replicas: {n: 2}}\n"))


@pytest.mark.parametrize(
    ("cluster", "message"),
    [
        ("  - {name: d, gpu: h100, model: llama-3-8b, role: decode}\n", "needs `link"),
        (SPLIT + "  - {name: h, gpu: h100, model: llama-3-8b}\n", "no `role: both`"),
        ("  - {name: p, gpu: h100, model: llama-3-8b, role: prefill}\n", "`role: decode` group"),
    ],
)
def test_bad_split_clusters_are_explained(tmp_path: Path, cluster: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        load_scenario(_scenario_file(tmp_path, cluster, "  direct: {kind: direct}\n"))


def test_tpot_is_time_after_the_first_token_per_further_token() -> None:
    state = np.array(["completed", "completed", "truncated", "timed_out"], dtype=object)
    cols = {
        "state": state,
        "tokens": np.array([11.0, 1.0, 5.0, 0.0]),
        "e2e": np.array([1.5, 1.0, 2.0, np.nan]),
        "ttft": np.array([0.5, 1.0, 1.0, np.nan]),
    }
    got = tpot(cols)
    assert got[0] == pytest.approx(0.1)
    assert got[2] == pytest.approx(0.25)
    assert np.isnan(got[1])  # one token: no time per further token
    assert np.isnan(got[3])
