"""Model shapes from Hugging Face config.json files (written for the test, in tests/sim/data)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmflow.presets import model, model_from_hf_config

DATA = Path(__file__).resolve().parent / "sim" / "data"


def test_llama_3_1_8b_from_its_config_json() -> None:
    m = model_from_hf_config(DATA / "llama-3.1-8b" / "config.json")
    # embeddings and lm_head 2 x 128256 x 4096; per layer q,o 2 x 4096^2, k,v 2 x 4096 x 1024,
    # SwiGLU 3 x 4096 x 14336, two norms; a final norm: Meta's published 8.03e9
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert m.params == 2 * 128256 * 4096 + 32 * per_layer + 4096 == 8_030_261_248
    assert m.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2 == 131072  # K and V, bf16
    assert (m.layers, m.heads, m.kv_heads, m.head_dim, m.dtype_bytes) == (32, 32, 8, 128, 2)
    assert m.compute_params == m.params
    preset = model("llama-3-8b")
    assert m.params == pytest.approx(preset.params, rel=1e-3)


def test_a_mixture_of_experts_counts_total_and_active_parameters() -> None:
    m = model_from_hf_config(DATA / "mixtral-8x7b" / "config.json")
    assert m.params == pytest.approx(46.7e9, rel=0.005)  # Mistral's published figures
    assert m.compute_params == pytest.approx(12.9e9, rel=0.005)
    assert m.weight_bytes == m.params * 2  # every expert sits in memory


def test_missing_keys_and_bad_values_are_named(tmp_path: Path) -> None:
    cfg = json.loads((DATA / "llama-3.1-8b" / "config.json").read_text())
    del cfg["vocab_size"], cfg["hidden_size"]
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config.json lacks \['hidden_size', 'vocab_size'\]"):
        model_from_hf_config(bad)
    bad.write_text(json.dumps({**cfg, "hidden_size": 8, "vocab_size": 8, "torch_dtype": "int3"}))
    with pytest.raises(ValueError, match="torch_dtype 'int3'"):
        model_from_hf_config(bad)
    with pytest.raises(ValueError, match="cannot read model config"):
        model_from_hf_config(tmp_path / "nope.json")
