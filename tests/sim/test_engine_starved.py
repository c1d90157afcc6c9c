"""Engine model where KV blocks are short: vLLM V1's admission, preemption and resume.

Each case is counted from the engine's step log (`EngineCore.step_log`), never from its own
counters, against a schedule worked out by hand from vLLM 0.32's rules (`docs/simulator.md`,
"Where KV blocks are short") or recorded from vLLM's own `Scheduler`
(`tests/integration/vllm_scheduler.py`, which `tests/integration/test_scheduler_parity.py` runs
live). The hand-worked schedules are also what vLLM's `Scheduler` gives for them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmflow.sim.costmodel import FixedStepCost
from llmflow.sim.engine import EngineConfig, EngineCore, Seq, StepRecord

from .invariants import check_engine

DATA = Path(__file__).parent / "data" / "vllm_scheduler_sharegpt_starved.json"


def engine_log(
    flags: dict[str, Any], requests: list[tuple[int, int, int]], checked: bool = True
) -> list[StepRecord]:
    """Run (arrival step, prompt, output) requests, one step per time unit; the step log.
    `checked`: the engine's block invariants are checked after every step (`check_engine`).
    Also drives `tests/integration/test_scheduler_parity.py`'s side of the comparison."""
    core = EngineCore(EngineConfig(**flags), FixedStepCost(1.0))
    core.step_log = log = []
    todo = sorted(enumerate(requests), key=lambda r: r[1][0])
    step = i = 0
    while i < len(todo) or not core.idle:
        while i < len(todo) and todo[i][1][0] <= step:
            rid, (_, prompt, out) = todo[i]
            core.add(Seq(rid, prompt, out), float(step))
            i += 1
        if core.schedule(float(step)) is not None:
            core.complete(float(step + 1))
            if checked:
                check_engine(core)
        step += 1
    return log


def _rows(log: list[StepRecord]) -> list[tuple[int, int, int, tuple[int, ...], int]]:
    return [(r.step, r.running, r.waiting, r.preempted, r.prefill_tokens) for r in log]


def test_a_decode_without_its_next_block_preempts_the_newest_which_resumes_later() -> None:
    # 9 blocks of 4 tokens, one of them the null block: 8 usable. a and b (8-token prompts, 12
    # tokens out) prefill together in step 0 (2 blocks each). Their decodes need a block when
    # the computed count reaches 8 (step 1), 12 (step 5) and 16 (step 9): at step 9 two are
    # needed and none is free, so the tail of the running list, b, is preempted (FCFS) and its
    # 4 blocks freed, full ones to the tail of the free queue; a's block comes from b's last.
    # b (17 tokens: 8 prompt, 9 generated) goes back to the front of the queue but needs all 5
    # blocks of its 17 tokens free (scheduler_reserve_full_isl) and only 3 are: it waits until a
    # ends (step 11), then resumes with its 3 surviving cached blocks (12 tokens) and recomputes
    # 5, sampling its 10th token; 2 more steps end it.
    log = engine_log({"max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size": 4,
                "max_model_len": 32, "num_gpu_blocks": 9}, [(0, 8, 12), (0, 8, 12)])
    assert _rows(log) == [
        (0, 2, 0, (), 16), *((s, 2, 0, (), 0) for s in range(1, 9)),
        (9, 1, 1, (1,), 0), (10, 1, 1, (), 0), (11, 0, 1, (), 0),
        (12, 1, 0, (), 5), (13, 1, 0, (), 0), (14, 0, 0, (), 0),
    ]


def test_admission_shares_the_budget_keeps_the_watermark_and_resumes_on_its_prefix() -> None:
    # 9 blocks of 4 (8 usable), 12 tokens per step, watermark int(0.12 * 9) = 1 block.
    # Step 0: a (8-token prompt) is admitted alone (no watermark with nothing running) and
    # takes 8 of the budget; b (9 tokens: 3 blocks + the watermark fit) gets the 4 left.
    # Step 1: a's decode takes 1, b's last 5 prompt tokens, and c (4 tokens: 1 block + the
    # watermark = the 2 free) its whole prompt: 10 tokens. c ends at step 3 (3 tokens).
    # At step 9 a and b both reach 16 computed tokens and need a block, none is free: b (the
    # newest) is preempted with 16 tokens (9 generated, 17 to resume) and a takes b's 4th
    # block. b needs 5 blocks and the watermark while a runs: it waits. a's block at step 13
    # (20 tokens) takes b's 3rd; a ends at step 13, and b resumes at step 14 alone with 2
    # cached blocks (8 tokens), recomputes 9 and samples its 9th and last token.
    log = engine_log({"max_num_seqs": 8, "max_num_batched_tokens": 12, "block_size": 4,
                "max_model_len": 32, "num_gpu_blocks": 9, "watermark": 0.12},
               [(0, 8, 14), (0, 9, 9), (0, 4, 3)])
    assert [(r.step, r.preempted, r.prefill_tokens, r.decodes) for r in log
            if r.preempted or r.prefill_tokens] == [
        (0, (), 12, 0), (1, (), 9, 1), (9, (1,), 0, 1), (14, (), 9, 0)]
    assert [(r.running, r.waiting) for r in log] == [
        (2, 1), (3, 0), (3, 0), *[(2, 0)] * 6, *[(1, 1)] * 4, (0, 1), (0, 0)]


def test_the_step_log_matches_vllm_schedulers_own_on_a_starved_sharegpt_load() -> None:
    # 60 ShareGPT-length requests arriving every 2 steps on average into 161 blocks of 16 (a
    # tenth of what they need at once): vLLM 0.32's Scheduler, driven with no model, took
    # 5,826 steps and preempted 105 times. The engine must give the same running and waiting
    # counts, preemptions and scheduled tokens at every step.
    data = json.loads(DATA.read_text(encoding="utf-8"))
    log = engine_log(data["engine"], [tuple(r) for r in data["requests"]])
    ours = [[r.running, r.waiting, len(r.preempted), r.decodes + r.prefill_tokens] for r in log]
    theirs = [row[1:] for row in data["vllm_steps_rle"] for _ in range(row[0])]
    assert len(ours) == len(theirs) == 5826
    assert sum(r[2] for r in theirs) == 105
    assert max(r[0] for r in theirs) == max(r[0] for r in ours)
    diverged = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    assert diverged is None, (diverged, ours[diverged], theirs[diverged])
