"""GPU and model presets: the public spec figures the capacity estimate and the simulator share.

Sources are cited in `docs/simulator.md` ("Sources"). Memory is in bytes, and a GPU's memory is
what CUDA reports as its total (`torch.cuda.mem_get_info()[1]`, vLLM's `total_gpu_memory`), not
the datasheet's round figure: NVIDIA's "80 GB" parts have 80 GiB of HBM, of which CUDA reports
about 79.2 GiB. Compute is in FLOP/s, bandwidth in bytes/s (datasheets, decimal).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmflow._core import kv_bytes_per_token

if TYPE_CHECKING:
    from pathlib import Path

__all__ = ["GIB", "GPUS", "MODELS", "GpuSpec", "ModelSpec", "gpu", "model", "model_from_hf_config"]

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
    active_params: float | None = None  # MoE: parameters one token passes through

    @property
    def weight_bytes(self) -> float:
        """Bytes of weights over all GPUs together."""
        return self.params * self.dtype_bytes

    @property
    def compute_params(self) -> float:
        """Parameters a token's forward pass multiplies by (all of them, unless MoE)."""
        return self.params if self.active_params is None else self.active_params

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


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4,
                "float8_e4m3fn": 1, "float8": 1}
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
             "vocab_size")
# Expert counts under the names the model families use (Qwen-MoE, Mixtral, DeepSeek).
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")


def model_from_hf_config(path: Path, name: str | None = None) -> ModelSpec:
    """A model's shape from its Hugging Face `config.json`.

    Reads `hidden_size`, `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`
    (default: the attention heads), `intermediate_size`, `vocab_size`, `torch_dtype` (or
    `dtype`; default bf16), `head_dim` when present, `tie_word_embeddings`, and for mixtures of
    experts `num_experts` (or `num_local_experts`, `n_routed_experts`), `num_experts_per_tok`,
    `moe_intermediate_size` and shared experts. The parameter count assumes a gated MLP
    (SwiGLU, as Llama, Mistral, Qwen) and no biases; it is within a fraction of a percent of
    the published counts for those families.

    Raises:
        ValueError: naming the file and the keys it lacks, or a value that is not a number.
    """
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"{path}: cannot read model config ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: a config.json holds one JSON object")
    cfg = {**cfg.get("text_config", {}), **cfg}  # multimodal configs nest the language model
    missing = [k for k in _REQUIRED if cfg.get(k) is None]
    if missing:
        raise ValueError(f"{path}: config.json lacks {missing} (a decoder-only model's "
                         "Hugging Face config has them)")
    try:
        return _hf_spec(cfg, name or str(cfg.get("_name_or_path") or path.parent.name))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None


def _hf_spec(cfg: dict[str, Any], name: str) -> ModelSpec:
    h, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or h // heads)
    vocab, inter = int(cfg["vocab_size"]), int(cfg["intermediate_size"])
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"torch_dtype {dtype!r} is not one of {sorted(_DTYPE_BYTES)}")
    attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2  # q and o, k and v
    experts = next((int(cfg[k]) for k in _EXPERTS if cfg.get(k)), 0)
    if experts:
        width = int(cfg.get("moe_intermediate_size") or inter)
        per_tok = int(cfg.get("num_experts_per_tok") or 0)
        if per_tok < 1:
            raise ValueError("a mixture of experts needs num_experts_per_tok")
        shared = int(cfg.get("shared_expert_intermediate_size") or 0) + int(
            cfg.get("n_shared_experts") or 0) * width
        mlp_all = 3 * h * (width * experts + shared) + h * experts  # experts, router
        mlp_active = 3 * h * (width * per_tok + shared) + h * experts
    else:
        mlp_all = mlp_active = 3 * h * inter
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)  # lm_head unless tied
    total = layers * (attn + mlp_all + 2 * h) + embed + h  # two norms a layer, one at the end
    active = layers * (attn + mlp_active + 2 * h) + embed + h
    return ModelSpec(name, float(total), layers, heads, kv_heads, head_dim, h, inter, vocab,
                     _DTYPE_BYTES[dtype], float(active) if experts else None)
