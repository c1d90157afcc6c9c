"""vLLM's memory profile: how much of a GPU is left for the KV cache, term by term.

vLLM does not hold back a fixed reserve. At start-up each worker measures what it needs besides
the KV cache (`Worker.determine_available_memory` in `vllm/v1/worker/gpu_worker.py`):

    kv_cache = total_gpu_memory * gpu_memory_utilization
               - weights - activation_peak - non_torch - cudagraph

* `total_gpu_memory`: what CUDA reports (`GpuSpec.hbm_bytes`), e.g. 79.22 GiB on an H100 80GB;
* `weights`: the model's bytes on this GPU (`weights / tp`);
* `activation_peak`: torch's peak while `profile_run` runs one forward pass over
  `max_num_batched_tokens` dummy tokens and then the sampler over `max_num_seqs` dummy requests
  (`gpu_model_runner.profile_run`, `_dummy_sampler_run`). The forward pass peaks in the MLP,
  where the input, the residual, the normed copy, the gate-up projection (2 x intermediate) and
  its activated half (intermediate) are alive together: `tokens * (3 * hidden + 3 *
  intermediate / tp) * dtype_bytes`. The sampler holds the batch's hidden states and float32
  logits, probabilities and one working copy over the vocabulary for every dummy request:
  `tokens * hidden * dtype_bytes + seqs * vocab * 12`. The larger of the two is the peak;
* `non_torch`: memory the process holds outside torch's allocator (cuBLAS workspaces, NCCL
  buffers), measured at 0.16 GiB on an H100 at TP 1 and 0.35 GiB on an RTX 3090;
* `cudagraph`: vLLM >= 0.21 also profiles CUDA-graph capture and subtracts its estimate
  (`VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1`, the default); older versions capture after sizing
  the cache, out of the `1 - gpu_memory_utilization` slack. It depends on the capture sizes and
  the vLLM version, so it is a knob (`cudagraph_bytes`, 0 by default): set it to the "Estimated
  CUDA graph memory" line of the vLLM log being modelled.

The activation term reproduces the published profile of Llama-3.1-8B on an RTX 3090 (vLLM issue
#10517: KV cache 3.81 GiB / 1,952 blocks at 20,000 batched tokens, 2.89 GiB / 1,478 blocks at
29,000) within 1%; `tests/sim/test_memory.py` holds it there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmflow.presets import GpuSpec, ModelSpec

__all__ = ["SAMPLER_BYTES_PER_LOGIT", "MemoryProfile", "memory_profile"]

SAMPLER_BYTES_PER_LOGIT = 12  # float32 logits, probabilities and one working copy per vocab entry


@dataclass(frozen=True)
class MemoryProfile:
    """vLLM's start-up memory profile of one GPU (bytes), as its log line reports it."""

    total: float  # total_gpu_memory
    requested: float  # total * gpu_memory_utilization
    weights: float
    activation_peak: float
    non_torch: float
    cudagraph: float

    @property
    def kv_cache(self) -> float:
        """Bytes left for the KV cache (negative when the model does not fit)."""
        return (
            self.requested - self.weights - self.activation_peak - self.non_torch - self.cudagraph
        )

    def blocks(self, block_size: int, kv_bytes_per_token: float) -> int:
        """vLLM's `num_gpu_blocks`: whole blocks of `block_size` tokens in the KV cache."""
        return max(0, math.floor(self.kv_cache / (block_size * kv_bytes_per_token)))


def activation_peak(model: ModelSpec, tp: int, tokens: int, seqs: int) -> float:
    """Torch's peak in vLLM's profile run on one GPU (see the module docstring), in bytes."""
    d = model.dtype_bytes
    mlp = tokens * (3 * model.hidden + 3 * model.intermediate / tp) * d
    sampler = tokens * model.hidden * d + seqs * model.vocab * SAMPLER_BYTES_PER_LOGIT
    return max(mlp, sampler)


def memory_profile(
    gpu: GpuSpec,
    model: ModelSpec,
    tp: int,
    *,
    gpu_memory_utilization: float,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    non_torch_bytes: float,
    cudagraph_bytes: float,
) -> MemoryProfile:
    """The memory profile vLLM would measure for `model` on `tp` GPUs of this kind.

    Args:
        gpu: the accelerator.
        model: the model's shape.
        tp: tensor-parallel degree.
        gpu_memory_utilization: vLLM's `--gpu-memory-utilization`.
        max_num_batched_tokens: tokens of the profile run's forward pass.
        max_num_seqs: dummy requests of the profile run's sampler.
        non_torch_bytes: memory outside torch's allocator.
        cudagraph_bytes: CUDA-graph memory taken from the KV cache (vLLM >= 0.21).
    """
    total = gpu.hbm_bytes
    return MemoryProfile(
        total=total,
        requested=math.ceil(total * gpu_memory_utilization),
        weights=model.weight_bytes / tp,
        activation_peak=activation_peak(model, tp, max_num_batched_tokens, max_num_seqs),
        non_torch=non_torch_bytes,
        cudagraph=cudagraph_bytes,
    )
