"""GPU and model presets: the public spec figures the capacity estimate and the simulator share.

Sources are cited in `docs/simulator.md` ("Sources"). Memory is in bytes, and a GPU's memory is
what CUDA reports as its total (`torch.cuda.mem_get_info()[1]`, vLLM's `total_gpu_memory`), not
the datasheet's round figure: NVIDIA's "80 GB" parts have 80 GiB of HBM, of which CUDA reports
about 79.2 GiB. Compute is in FLOP/s, bandwidth in bytes/s (datasheets, decimal).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmflow._core import kv_bytes_per_token

__all__ = ["GIB", "GPUS", "MODELS", "GpuSpec", "ModelSpec", "gpu", "model"]

GIB = 1024**3  # bytes in a GiB


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator's datasheet figures."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes: float  # device memory as CUDA reports its total (vLLM's total_gpu_memory)
    hbm_bandwidth: float  # bytes/s
    pcie_bandwidth: float  # bytes/s host link, for swap-to-CPU preemption


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only transformer, enough to cost it and to size its activations."""

    name: str
    params: float  # parameter count
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int  # MLP width (config.json `intermediate_size`)
    vocab: int  # config.json `vocab_size`
    dtype_bytes: int = 2  # bf16

    @property
    def weight_bytes(self) -> float:
        """Bytes of weights over all GPUs together."""
        return self.params * self.dtype_bytes

    def kv_bytes_per_token(self, tp: int = 1) -> int:
        """KV bytes one token takes on each of `tp` GPUs."""
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, self.dtype_bytes, tp)


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("a100-80g", 312e12, 79.14 * GIB, 2.04e12, 25e9),
        GpuSpec("h100", 989e12, 79.22 * GIB, 3.35e12, 50e9),
        GpuSpec("h200", 989e12, 139.6 * GIB, 4.8e12, 50e9),  # estimate: no CUDA figure found
        GpuSpec("l40s", 362e12, 44.42 * GIB, 0.864e12, 25e9),
        GpuSpec("l4", 121e12, 22.03 * GIB, 0.3e12, 25e9),
        GpuSpec("rtx-4090", 165.2e12, 23.68 * GIB, 1.008e12, 25e9),
    )
}

MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("llama-3-8b", 8.03e9, 32, 32, 8, 128, 4096, 14336, 128256),
        ModelSpec("llama-3-70b", 70.6e9, 80, 64, 8, 128, 8192, 28672, 128256),
        ModelSpec("qwen2.5-32b", 32.8e9, 64, 40, 8, 128, 5120, 27648, 152064),
        ModelSpec("llama-2-7b", 6.74e9, 32, 32, 32, 128, 4096, 11008, 32000),
    )
}


def gpu(name: str) -> GpuSpec:
    """Look up a GPU preset by name.

    Raises:
        KeyError: naming the presets that exist.
    """
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise KeyError(f"unknown GPU {name!r}; choose one of {sorted(GPUS)}") from None


def model(name: str) -> ModelSpec:
    """Look up a model preset by name.

    Raises:
        KeyError: naming the presets that exist.
    """
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; choose one of {sorted(MODELS)}") from None
