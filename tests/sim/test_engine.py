"""Engine model: vLLM V1 scheduling, KV accounting, preemption, aborts."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import pytest

from llmflow.sim.cluster import Backend, Gauges
from llmflow.sim.costmodel import FixedStepCost
from llmflow.sim.engine import DONE, EngineConfig, EngineCore, EngineError, Seq

from .invariants import check_engine

if TYPE_CHECKING:
    import simpy


def _core(**flags: Any) -> EngineCore:
    base = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size": 4,
            "max_model_len": 64, "num_gpu_blocks": 40}
    return EngineCore(EngineConfig(**{**base, **flags}), FixedStepCost(1.0))


def _run(core: EngineCore, seqs: list[Seq]) -> None:
    now = 0.0
    for s in seqs:
        core.add(s, now)
    while not core.idle:
        now += core.schedule(now) or 0.0
        core.complete(now)
        check_engine(core)


def test_chunked_prefill_then_one_token_per_step(env: simpy.Environment, log: Any) -> None:
    # a 100-token prompt with a 64-token budget: two prefill steps, the first token at the end
    # of the second, then one token per step
    core = _core(max_model_len=128)
    b = Backend(env, "b", core, Gauges(env, core.num_blocks))
    b.submit(Seq(1, 100, 3, owner=log))
    env.run()
    assert log == [("first 1", 2.0), ("end 1", 4.0)]


def test_waiting_requests_join_at_step_boundaries(env: simpy.Environment, log: Any) -> None:
    core = _core()
    b = Backend(env, "b", core, Gauges(env, core.num_blocks))
    b.submit(Seq(1, 8, 2, owner=log))

    def late() -> Any:
        yield env.timeout(0.5)
        b.submit(Seq(2, 8, 1, owner=log))

    env.process(late())
    env.run()
    assert log == [("first 1", 1.0), ("first 2", 2.0), ("end 2", 2.0), ("end 1", 2.0)]


def test_fcfs_preempts_the_newest_and_recomputes_it() -> None:
    # 40 blocks of 4 tokens; two 60-token sequences cannot both grow: the later one is preempted
    core = _core(num_gpu_blocks=20, max_model_len=80)
    a, b = Seq(1, 30, 40), Seq(2, 30, 40)
    _run(core, [a, b])
    assert (a.preemptions, b.preemptions) == (0, 1)
    assert core.num_preemptions == 1
    assert a.gen == b.gen == 40


def test_priority_preempts_the_worst_priority() -> None:
    core = _core(num_gpu_blocks=20, max_model_len=80, scheduling_policy="priority")
    a, b = Seq(1, 30, 40, priority=5), Seq(2, 30, 40, priority=0)
    _run(core, [a, b])
    assert (a.preemptions, b.preemptions) == (1, 0)


def test_swap_keeps_progress_and_pays_pcie() -> None:
    core = _core(num_gpu_blocks=20, max_model_len=80, preemption_mode="swap",
                 swap_space_blocks=100)
    a, b = Seq(1, 30, 40), Seq(2, 30, 40)
    _run(core, [a, b])
    assert b.preemptions == 1
    assert b.gen == 40
    assert core.cpu_used == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_kv_blocks_never_exceed_capacity(mode: str, policy: str) -> None:
    # random arrivals, aborts (also mid-step) and client stops; every counter re-derived
    rng = random.Random(f"{mode}{policy}")
    core = EngineCore(EngineConfig(max_num_seqs=32, max_num_batched_tokens=512, block_size=16,
                                   max_model_len=1024, num_gpu_blocks=200,
                                   scheduling_policy=policy, preemption_mode=mode,  # type: ignore[arg-type]
                                   swap_space_blocks=100), FixedStepCost(0.01))
    now, seqs, ended = 0.0, [], {}
    for i in range(2500):
        if rng.random() < 0.3:
            s = Seq(i, rng.randint(1, 500), rng.randint(1, 500),
                    rng.choice([None, rng.randint(1, 400)]), rng.randint(0, 3), None,
                    rng.choice([None, None, rng.randint(1, 100)]))
            core.add(s, now)
            seqs.append(s)
        if rng.random() < 0.02 and seqs:
            core.abort(rng.choice(seqs), now)
        dt = core.schedule(now)
        if dt is None:
            continue
        assert core.used <= core.num_blocks
        if rng.random() < 0.05 and seqs:
            core.abort(rng.choice(seqs), now)
        now += dt
        for s in core.complete(now)[1]:
            assert s.rid not in ended
            ended[s.rid] = s.gen
        check_engine(core)
    while not core.idle:
        now += core.schedule(now) or 0.0
        assert core.used <= core.num_blocks
        core.complete(now)
        check_engine(core)
    assert core.peak_used <= core.num_blocks
    assert all(s.state == DONE for s in seqs)
    assert core.used == 0
    assert core.cpu_used == 0
    assert core.generation_tokens_total == sum(s.gen for s in seqs)
    assert core.num_preemptions > 0  # the workload did overflow the cache


def test_abort_frees_blocks_at_once() -> None:
    core = _core()
    s = Seq(1, 20, 30)
    core.add(s, 0.0)
    core.complete(core.schedule(0.0) or 0.0)
    assert core.used == 5  # 20 prompt tokens in 4-token blocks (the sampled one is not cached)
    assert core.abort(s, 1.0)
    assert core.used == 0
    assert s.state == DONE
    assert not core.abort(s, 1.0)


def test_too_long_is_refused_like_vllm() -> None:
    core = _core()
    with pytest.raises(EngineError, match="maximum context length is 64 tokens"):
        core.add(Seq(1, 60, 10), 0.0)


def test_max_model_len_must_fit_the_cache() -> None:
    with pytest.raises(EngineError, match="lower max_model_len"):
        _core(num_gpu_blocks=4)


def test_owner_hears_when_a_token_count_is_reached(env: simpy.Environment, log: Any) -> None:
    class Owner(type(log)):  # type: ignore[misc]
        def on_tokens_reached(self, seq: Seq, now: float) -> None:
            self.append((f"reached {seq.rid}", now))

    owner = Owner()
    core = _core()
    b = Backend(env, "b", core, Gauges(env, core.num_blocks))
    b.submit(Seq(1, 8, 6, owner=owner, notify_at=4))
    env.run()
    # token 1 at the end of step 1, token 4 at the end of step 4, the 6th ends it
    assert owner == [("first 1", 1.0), ("reached 1", 4.0), ("end 1", 6.0)]


class _Steps(FixedStepCost):
    """One-second steps that record (decodes, prompt tokens computed) of every step."""

    def __init__(self) -> None:
        super().__init__(1.0)
        self.steps: list[tuple[int, int]] = []

    def step_time(
        self, decodes: int, decode_ctx: int, prefill_tokens: int, prefill_attn: int,
        prefill_ctx: int, swap_bytes: float,
    ) -> float:
        self.steps.append((decodes, prefill_tokens))
        return 1.0


@pytest.mark.parametrize(("caching", "recomputed"), [(True, 33), (False, 41)])
def test_a_resumed_request_recomputes_only_its_evicted_blocks(caching: bool,
                                                              recomputed: int) -> None:
    # 21 blocks of 4 tokens, one of them vLLM V1's null block: 20 usable (vLLM 0.32's own
    # Scheduler recomputes 33 tokens here too). b is preempted holding 40 tokens (10 full
    # blocks, freed to the tail of the free queue, last block first); a grows to 69 computed
    # tokens = 18 blocks, taking the 8 never-used blocks and then b's last 8. b's first 2
    # blocks (8 tokens) survive, so its resume (41 tokens: 30 prompt, 11 generated) computes 33
    # with prefix caching, 41 without.
    cost = _Steps()
    core = EngineCore(EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, block_size=4,
                                   max_model_len=80, num_gpu_blocks=21,
                                   enable_prefix_caching=caching), cost)
    a, b = Seq(1, 30, 40), Seq(2, 30, 40)
    _run(core, [a, b])
    assert (a.preemptions, b.preemptions) == (0, 1)
    prefills = [p for _, p in cost.steps if p]
    assert prefills == [60, recomputed]
    assert a.gen == b.gen == 40


@pytest.mark.parametrize(("full_isl", "preemptions"), [(True, 0), (False, 2)])
def test_admission_waits_until_the_whole_prompt_fits(full_isl: bool, preemptions: int) -> None:
    # 21 blocks (20 usable: one is vLLM V1's null block), 16 tokens per step. a (40-token
    # prompt) prefills in 16 + 16 + 8; 8 tokens of budget are left in that step, enough for a
    # first chunk of b (48 tokens = 12 blocks) but not for all of it beside a's 10 blocks.
    # vLLM's default (scheduler_reserve_full_isl) keeps b waiting until a ends; checking only
    # the chunk over-admits b, and a's growth then preempts it (twice).
    cost = _Steps()
    core = EngineCore(EngineConfig(max_num_seqs=8, max_num_batched_tokens=16, block_size=4,
                                   max_model_len=80, num_gpu_blocks=21,
                                   scheduler_reserve_full_isl=full_isl), cost)
    a, b = Seq(1, 40, 20), Seq(2, 48, 20)
    _run(core, [a, b])
    assert core.num_preemptions == b.preemptions == preemptions
    assert cost.steps[2] == ((0, 8) if full_isl else (0, 16))  # b's first chunk or not


def test_the_watermark_keeps_blocks_free_when_admitting() -> None:
    # with a running request, a 10% watermark (2 of 21 blocks, int(0.1 * 21) as vLLM rounds)
    # must stay free at admission; 20 of the 21 are usable (one is vLLM V1's null block)
    cost = _Steps()
    core = EngineCore(EngineConfig(max_num_seqs=8, max_num_batched_tokens=128, block_size=4,
                                   max_model_len=80, num_gpu_blocks=21, watermark=0.1), cost)
    a, b = Seq(1, 36, 4), Seq(2, 36, 4)  # 9 blocks each: 18 + 2 = 20 fits exactly, then b
    _run(core, [a, b])
    assert cost.steps[0] == (0, 72)
    core2 = EngineCore(EngineConfig(max_num_seqs=8, max_num_batched_tokens=128, block_size=4,
                                    max_model_len=80, num_gpu_blocks=21, watermark=0.15), cost)
    cost.steps.clear()
    _run(core2, [Seq(3, 36, 4), Seq(4, 36, 4)])  # 3 blocks kept free: b waits for a
    assert cost.steps[0] == (0, 36)


def test_a_shared_prefix_is_not_prefilled_again() -> None:
    # Blocks of 4 tokens, hash ids per block. a (30 tokens: 7 full blocks) runs first; b shares
    # a's first 5 blocks and arrives once a's first token is out, so it prefills only its 10
    # other tokens; c shares nothing and prefills all 30. A hit stops at the first missing hash.
    cost = _Steps()
    core = EngineCore(EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, block_size=4,
                                   max_model_len=80, num_gpu_blocks=40), cost)
    shared = tuple(range(5))
    a = Seq(1, 30, 2, hash_ids=(*shared, 5, 6), hash_block=4)
    b = Seq(2, 30, 2, hash_ids=(*shared, 50, 60), hash_block=4)
    c = Seq(3, 30, 2, hash_ids=(9, *shared[1:]), hash_block=4)
    for seq in (a, b, c):
        _run(core, [seq])
    prefills = [p for _, p in cost.steps if p]
    assert prefills == [30, 10, 30]
    assert (core.prefix_query_tokens, core.prefix_hit_tokens) == (90, 20)


def test_the_prefix_cache_evicts_the_least_recently_used() -> None:
    # 10 blocks of 4 tokens hold 10 hash ids. a's 5, b's 5, then c's 5 evict a's (the oldest).
    # b hits (all but its last token) and is refreshed, so a's return evicts c's, not b's: b
    # hits again.
    cost = _Steps()
    core = EngineCore(EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, block_size=4,
                                   max_model_len=40, num_gpu_blocks=10), cost)

    def seq(rid: int, first: int) -> Seq:
        return Seq(rid, 21, 1, hash_ids=tuple(range(first, first + 5)), hash_block=4)

    for rid, first in enumerate((0, 10, 20, 10, 0, 10)):
        _run(core, [seq(rid, first)])
    prefills = [p for _, p in cost.steps if p]
    assert prefills == [21, 21, 21, 1, 21, 1]
