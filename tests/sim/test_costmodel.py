"""Preset fidelity: the engine model lands within 25% of NVIDIA AIConfigurator's vLLM figures.

Reference: shared/reference/README.md, "Published latencies" (vLLM, bf16, static mode, output
256 tokens). TTFT is measured on an idle engine; TPOT is the mean inter-token time of a batch of
1, 16 or 64 requests with 1,024-token prompts decoding 256 tokens together.
"""

from __future__ import annotations

import pytest

from llmflow.presets import gpu, model
from llmflow.sim.costmodel import CostModel, Knobs, cost_model
from llmflow.sim.engine import EngineConfig, EngineCore, Seq

# (gpu, model, tp): TTFT 1k, TTFT 4k, TPOT b1, b16, b64 in milliseconds
AICONFIGURATOR = {
    ("h100", "llama-3-8b", 1): (22, 90, 6.2, 7.6, 10.6),
    ("a100-80g", "llama-3-8b", 1): (65, 259, 11.9, 13.8, 18.4),
    ("h200", "llama-3-8b", 1): (21, 93, 4.9, 5.8, 7.8),
    ("h100", "llama-3-70b", 4): (67, 264, 14.9, 16.4, 19.3),
    ("a100-80g", "llama-3-70b", 4): (182, 666, 27.2, 30.8, 36.8),
}


def _engine(key: tuple[str, str, int], budget: int = 8192) -> EngineCore:
    return EngineCore(EngineConfig(max_model_len=8192, max_num_batched_tokens=budget),
                      cost_model(*key))


def ttft_ms(key: tuple[str, str, int], prompt: int) -> float:
    """First-token time of one request on an idle engine."""
    core = _engine(key)
    core.add(Seq(1, prompt, 256), 0.0)
    now = 0.0
    while True:
        now += core.schedule(now) or 0.0
        first, _ = core.complete(now)
        if first:
            return now * 1e3


def tpot_ms(key: tuple[str, str, int], batch: int) -> float:
    """Mean inter-token time of `batch` requests decoding 256 tokens together (static mode: the
    whole batch is prefilled in one step, then decodes alone)."""
    core = _engine(key, budget=batch * 1024 + 256)
    seqs = [Seq(i, 1024, 256) for i in range(batch)]
    for s in seqs:
        core.add(s, 0.0)
    now = 0.0
    while not core.idle:
        now += core.schedule(now) or 0.0
        core.complete(now)
    return sum((s.t_end - s.t_first) / 255 for s in seqs) / batch * 1e3


@pytest.mark.parametrize("key", list(AICONFIGURATOR))
def test_presets_within_25_percent_of_aiconfigurator(key: tuple[str, str, int]) -> None:
    want = AICONFIGURATOR[key]
    got = (ttft_ms(key, 1024), ttft_ms(key, 4096), tpot_ms(key, 1), tpot_ms(key, 16),
           tpot_ms(key, 64))
    for name, g, w in zip(("ttft1k", "ttft4k", "tpot1", "tpot16", "tpot64"), got, want,
                          strict=True):
        assert abs(g - w) / w <= 0.25, f"{key} {name}: model {g:.1f} ms vs published {w} ms"


def test_every_gpu_and_model_preset_builds() -> None:
    # every combination that fits gives a positive step time and KV capacity
    for g in ("a100-80g", "h100", "h200", "l40s"):
        for m, tp in (("llama-3-8b", 1), ("qwen2.5-32b", 2), ("llama-3-70b", 4)):
            cm = cost_model(g, m, tp)
            assert cm.kv_blocks(16) > 0
            assert 0 < cm.step_time(8, 8000, 512, 512 * 512, 512, 0.0) < 1.0


def test_kv_bytes_per_token_match_the_reference() -> None:
    # shared/reference/README.md: 128 KiB (Llama-3-8B), 320 KiB (70B), 256 KiB (Qwen2.5-32B)
    for name, kib in (("llama-3-8b", 128), ("llama-3-70b", 320), ("qwen2.5-32b", 256),
                      ("llama-2-7b", 512)):
        assert CostModel(gpu("h100"), model(name)).kv_bytes_per_token == kib * 1024


def test_decode_is_memory_bound_and_prefill_compute_bound() -> None:
    cm = cost_model("h100", "llama-3-8b")
    one = cm.step_time(1, 1000, 0, 0, 0, 0.0)
    assert cm.step_time(2, 2000, 0, 0, 0, 0.0) < 1.1 * one  # a second decode is nearly free
    assert cm.step_time(0, 0, 4096, 4096 * 4096, 4096, 0.0) > 3 * cm.step_time(
        0, 0, 1024, 1024 * 1024, 1024, 0.0)  # prefill grows with its tokens


def test_weights_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        CostModel(gpu("l40s"), model("llama-3-70b"), 1).kv_blocks(16)


def test_unknown_knob_is_named() -> None:
    with pytest.raises(ValueError, match="unknown cost-model knob"):
        Knobs().with_overrides({"mfu": 0.5})
