"""vLLM's memory profile (`llmflow.sim.memory`) against published start-up logs."""

from __future__ import annotations

import pytest

from llmflow.presets import GIB, GpuSpec, model
from llmflow.sim.costmodel import CostModel, Knobs, cost_model


@pytest.mark.parametrize(("batched_tokens", "published_blocks"), [(20_000, 1952), (29_000, 1478)])
def test_llama_8b_on_rtx_3090_matches_vllm_log(batched_tokens: int, published_blocks: int) -> None:
    # vllm-project/vllm#10517: Llama-3.1-8B on an RTX 3090, total_gpu_memory 23.58 GiB,
    # gpu_memory_utilization 0.9, non_torch_memory 0.35 GiB, max-model-len 20k / 29k (the
    # profile's batched tokens then), 256 sequences: "# GPU blocks: 1952" and "1478"
    rtx_3090 = GpuSpec("rtx-3090", 71e12, 23.58 * GIB, 0.936e12, 25e9)
    cm = CostModel(rtx_3090, model("llama-3-8b"), 1, Knobs(non_torch_bytes=0.35 * GIB))
    blocks = cm.kv_blocks(16, batched_tokens, 256)
    assert abs(blocks - published_blocks) / published_blocks < 0.02, blocks


def test_the_activation_reserve_grows_with_the_batch_and_the_sampler() -> None:
    # the reserve is measured, not flat: more batched tokens or more dummy requests, fewer blocks
    cm = cost_model("h100", "llama-3-8b")
    assert cm.kv_blocks(16, 2048, 256) > cm.kv_blocks(16, 8192, 256) > cm.kv_blocks(16, 16384, 256)
    assert cm.kv_blocks(16, 2048, 256) > cm.kv_blocks(16, 2048, 1024)
    # a CUDA-graph estimate (vLLM >= 0.21) comes out of the cache, block for block
    with_graphs = cost_model("h100", "llama-3-8b", overrides={"cudagraph_bytes": GIB})
    freed = (cm.kv_blocks(16) - with_graphs.kv_blocks(16)) * 16 * cm.kv_bytes_per_token
    assert GIB - 16 * cm.kv_bytes_per_token <= freed <= GIB + 16 * cm.kv_bytes_per_token


def test_gpus_count_in_gib_as_cuda_reports() -> None:
    # vllm-project/vllm#12126: "total_gpu_memory (79.22GiB)" on an H100 80GB
    mem = cost_model("h100", "llama-3-8b").memory()
    assert mem.total == pytest.approx(79.22 * GIB)
    # Llama-3-8B's weights: 14.96 GiB ("model weights take 14.99GiB" with the embedding padding)
    assert mem.weights / GIB == pytest.approx(14.96, abs=0.01)


def test_a_model_that_does_not_fit_says_why() -> None:
    with pytest.raises(ValueError, match=r"GiB of weights .* GiB of activations"):
        cost_model("l4", "qwen2.5-32b").kv_blocks(16)
