"""Roofline cost model: how long one vLLM engine step takes, and how many KV blocks fit.

One step is one forward pass over a mixed batch (vLLM V1 chunked prefill): `D` decoding
sequences (one token each) plus prefill chunks. Its time is

    overhead + max(compute, memory) + all-reduce + swap

* compute: `(2 * params * tokens + 2 * layers * heads * head_dim * attn) / (tp * peak * mfu)`,
  where `attn` sums `n * (2 * offset + n)` over prefill chunks (causal attention of `n` new tokens
  over `offset` earlier ones) and `2 * ctx + 1` over decodes;
* memory: `(weights + kv_bytes_per_token * tokens_read) / (tp * hbm_bandwidth * decode_bw_eff)`;
* all-reduce (tensor parallel only): two ring all-reduces of the activations per layer, each a
  fixed latency plus `2 * (tp - 1) / tp * bytes / link_bandwidth`;
* swap: bytes moved to or from host memory over PCIe (swap preemption only).

The formulas are those of `shared/reference/README.md` (BLIS, DistServe, Splitwise). The knobs
(`Knobs`) are calibrated per GPU against NVIDIA AIConfigurator's vLLM figures; the test
`tests/sim/test_costmodel.py` holds every preset within 25% of that table.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from llmflow.presets import GIB, GpuSpec, ModelSpec, gpu, model
from llmflow.sim.memory import MemoryProfile, memory_profile

__all__ = ["CALIBRATION", "CostModel", "FixedStepCost", "Knobs", "StepCost", "cost_model"]


@dataclass(frozen=True)
class Knobs:
    """Calibration knobs of the cost model (all per GPU)."""

    mfu_prefill: float = 0.6  # fraction of peak FLOP/s a prefill reaches
    decode_bw_eff: float = 0.7  # fraction of HBM bandwidth a decode step reaches
    overhead_s: float = 1e-3  # fixed cost of one step (scheduler, launch, sampling) at TP 1
    overhead_per_extra_gpu_s: float = 0.25e-3  # added per GPU beyond the first
    allreduce_latency_s: float = 10e-6  # fixed cost of one all-reduce
    link_bandwidth: float = 300e9  # effective all-reduce bus bandwidth, bytes/s
    gpu_memory_utilization: float = 0.9  # vLLM's --gpu-memory-utilization
    non_torch_bytes: float = 0.16 * GIB  # per GPU outside torch's allocator (see sim/memory.py)
    cudagraph_bytes: float = 0.0  # CUDA-graph memory vLLM >= 0.21 takes from the KV cache

    def with_overrides(self, overrides: dict[str, Any] | None) -> Knobs:
        """A copy with some knobs replaced.

        Raises:
            ValueError: an unknown knob name.
        """
        if not overrides:
            return self
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown cost-model knob(s) {unknown}; known: {sorted(known)}")
        return replace(self, **{k: float(v) for k, v in overrides.items()})


# Per-GPU calibration against AIConfigurator (vLLM, bf16, static mode); see docs/simulator.md.
CALIBRATION: dict[str, Knobs] = {
    "h100": Knobs(mfu_prefill=0.78, decode_bw_eff=0.8, overhead_s=0.5e-3),
    "h200": Knobs(mfu_prefill=0.78, decode_bw_eff=0.7, overhead_s=0.5e-3),
    "a100-80g": Knobs(mfu_prefill=0.82, decode_bw_eff=0.7, overhead_s=0.5e-3, link_bandwidth=230e9),
    "l40s": Knobs(mfu_prefill=0.6, decode_bw_eff=0.7, overhead_s=1e-3, link_bandwidth=20e9,
                  allreduce_latency_s=20e-6),
}


class StepCost:
    """Interface of a step-time model, as the engine calls it."""

    kv_bytes_per_token: float  # bytes one token's KV takes on one GPU

    def step_time(
        self, decodes: int, decode_ctx: int, prefill_tokens: int, prefill_attn: int,
        prefill_ctx: int, swap_bytes: float,
    ) -> float:
        """Seconds one step takes (see the module docstring for the terms)."""
        raise NotImplementedError

    def kv_blocks(
        self, block_size: int, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256
    ) -> int:
        """KV blocks of `block_size` tokens that fit in GPU memory (vLLM's profile run sizes
        its activations from the two engine limits)."""
        raise NotImplementedError


class CostModel(StepCost):
    """Roofline step time for one model on `tp` GPUs of one kind.

    Args:
        gpu: the accelerator's datasheet figures.
        model: the model's shape.
        tp: tensor-parallel degree (GPUs behind one vLLM instance).
        knobs: calibration; defaults to `CALIBRATION[gpu.name]`.
    """

    def __init__(self, gpu: GpuSpec, model: ModelSpec, tp: int = 1, knobs: Knobs | None = None):
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        self.gpu, self.model, self.tp = gpu, model, tp
        self.knobs = k = knobs or CALIBRATION.get(gpu.name, Knobs())
        self.kv_bytes_per_token = model.kv_bytes_per_token(tp)
        self._kv_total = float(self.kv_bytes_per_token * tp)
        self._linear = 2.0 * model.compute_params
        self._attn = 2.0 * model.layers * model.heads * model.head_dim
        self._compute_rate = tp * gpu.peak_flops * k.mfu_prefill
        self._mem_rate = tp * gpu.hbm_bandwidth * k.decode_bw_eff
        self._weights = model.weight_bytes
        self._overhead = k.overhead_s + k.overhead_per_extra_gpu_s * (tp - 1)
        n_allreduce = 2 * model.layers if tp > 1 else 0
        self._ar_fixed = n_allreduce * k.allreduce_latency_s
        ring = 2.0 * (tp - 1) / tp
        activation_bytes = model.hidden * model.dtype_bytes  # per token, per all-reduce
        self._ar_per_token = n_allreduce * activation_bytes * ring / k.link_bandwidth
        self._pcie = gpu.pcie_bandwidth

    def step_time(
        self, decodes: int, decode_ctx: int, prefill_tokens: int, prefill_attn: int,
        prefill_ctx: int, swap_bytes: float,
    ) -> float:
        """Seconds one mixed step takes.

        Args:
            decodes: sequences decoding one token each.
            decode_ctx: their context lengths, summed.
            prefill_tokens: prompt tokens computed in this step (all chunks).
            prefill_attn: `sum(n * (2 * offset + n))` over the prefill chunks.
            prefill_ctx: `sum(offset + n)` over the chunks (KV they read and write).
            swap_bytes: bytes swapped to or from host memory per GPU in this step.
        """
        tokens = decodes + prefill_tokens
        flops = self._linear * tokens + self._attn * (prefill_attn + 2 * decode_ctx + decodes)
        compute = flops / self._compute_rate
        memory = (self._weights + self._kv_total * (decode_ctx + prefill_ctx)) / self._mem_rate
        allreduce = self._ar_fixed + self._ar_per_token * tokens if self._ar_fixed else 0.0
        swap = swap_bytes / self._pcie if swap_bytes else 0.0
        return self._overhead + (compute if compute > memory else memory) + allreduce + swap

    def memory(self, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256) -> MemoryProfile:
        """vLLM's start-up memory profile of one GPU (`llmflow.sim.memory`)."""
        k = self.knobs
        return memory_profile(
            self.gpu, self.model, self.tp, gpu_memory_utilization=k.gpu_memory_utilization,
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            non_torch_bytes=k.non_torch_bytes, cudagraph_bytes=k.cudagraph_bytes)

    def kv_blocks(
        self, block_size: int, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256
    ) -> int:
        """vLLM's `num_gpu_blocks`: what its memory profile leaves, in blocks.

        Raises:
            ValueError: the weights and the profile's activations do not fit.
        """
        mem = self.memory(max_num_batched_tokens, max_num_seqs)
        if mem.kv_cache <= 0:
            raise ValueError(
                f"{self.model.name} does not fit on {self.tp} x {self.gpu.name}: "
                f"{mem.weights / GIB:.1f} GiB of weights and {mem.activation_peak / GIB:.1f} GiB "
                f"of activations per GPU in {mem.requested / GIB:.1f} GiB "
                "(gpu_memory_utilization x total)"
            )
        return mem.blocks(block_size, self.kv_bytes_per_token)

    def swap_seconds(self, blocks: int, block_size: int) -> float:
        """Time to move `blocks` KV blocks across PCIe (each GPU moves its shard in parallel)."""
        return blocks * block_size * self.kv_bytes_per_token / self._pcie


class FixedStepCost(StepCost):
    """Every step takes `dt` seconds whatever the batch: turns the engine into an M/M/c-like
    server for validation against queueing formulas.

    Args:
        dt: seconds per step.
        blocks: KV blocks to report as capacity.
    """

    def __init__(self, dt: float, blocks: int = 1_000_000):
        self.dt = dt
        self.blocks = blocks
        self.kv_bytes_per_token = 1.0

    def step_time(
        self, decodes: int, decode_ctx: int, prefill_tokens: int, prefill_attn: int,
        prefill_ctx: int, swap_bytes: float,
    ) -> float:
        """Always `dt`."""
        return self.dt

    def kv_blocks(
        self, block_size: int, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256
    ) -> int:
        """Always `blocks`."""
        return self.blocks


def cost_model(
    gpu_name: str | GpuSpec, model_name: str | ModelSpec, tp: int = 1,
    overrides: dict[str, Any] | None = None,
) -> CostModel:
    """Build a `CostModel` from preset names (or specs), with optional knob overrides.

    Raises:
        KeyError: an unknown GPU or model preset.
        ValueError: an unknown knob.
    """
    g = gpu(gpu_name) if isinstance(gpu_name, str) else gpu_name
    m = model(model_name) if isinstance(model_name, str) else model_name
    knobs = CALIBRATION.get(g.name, Knobs()).with_overrides(overrides)
    return CostModel(g, m, tp, knobs)
