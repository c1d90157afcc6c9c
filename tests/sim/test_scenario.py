"""Scenario files: hardware as a datasheet mapping, models from a Hugging Face config.json."""

from __future__ import annotations

from pathlib import Path

import pytest
import simpy

from llmflow.presets import GIB, gpu
from llmflow.sim.cluster import Cluster
from llmflow.sim.scenario import ScenarioError, load_scenario

_H100 = gpu("h100")
_WORKLOAD = ("workload: [{name: c, tenant: t, arrival: {kind: poisson, rate_per_s: 1},\n"
             "  prompt_tokens: {kind: fixed, value: 8}, output_tokens: {kind: fixed, value: 8}}]\n")


def _write(tmp_path: Path, backend: str) -> Path:
    f = tmp_path / "s.yaml"
    f.write_text(f"title: x\nduration_s: 10\ncluster:\n  - {backend}\n{_WORKLOAD}")
    return f


def test_a_datasheet_gpu_and_a_config_json_model_cost_as_the_presets_do(tmp_path: Path) -> None:
    config = tmp_path / "llama" / "config.json"
    config.parent.mkdir()
    src = Path(__file__).parent / "data" / "llama-3.1-8b" / "config.json"
    config.write_text(src.read_text())
    mapping = (f"{{name: h100, peak_tflops: {_H100.peak_flops / 1e12}, "
               f"memory_gib: {_H100.hbm_bytes / GIB}, bandwidth_gb_s: {_H100.hbm_bandwidth / 1e9}, "
               f"pcie_gb_s: {_H100.pcie_bandwidth / 1e9}}}")
    custom = load_scenario(_write(tmp_path, f"{{name: a, gpu: {mapping}, "
                                            "model: llama/config.json}"))  # relative to the file
    preset = load_scenario(_write(tmp_path, "{name: a, gpu: h100, model: llama-3-8b}"))
    a, b = (Cluster(simpy.Environment(), sc.cluster, None).backends[0].core
            for sc in (custom, preset))
    # the config's 8.0303e9 parameters against the preset's 8.03e9: the same card within a block
    assert a.num_blocks == pytest.approx(b.num_blocks, abs=1)
    args = (64, 64 * 1000, 512, 512 * 512, 512, 0.0)  # 64 decodes at 1k context, a 512 prefill
    assert a.cost.step_time(*args) == pytest.approx(b.cost.step_time(*args), rel=1e-3)


def test_a_faster_memory_makes_decode_steps_faster(tmp_path: Path) -> None:
    cores = []
    for bw in (2000, 4000):
        sc = load_scenario(_write(tmp_path, "{name: a, model: llama-3-8b, gpu: {peak_tflops: "
                                            f"500, memory_gib: 80, bandwidth_gb_s: {bw}}}}}"))
        cores.append(Cluster(simpy.Environment(), sc.cluster, None).backends[0].core)
    slow, fast = (c.cost.step_time(8, 8 * 512, 0, 0, 0, 0.0) for c in cores)
    assert 1.6 < slow / fast < 2.0  # memory-bound decode; the fixed overhead does not scale
    assert cores[0].num_blocks == cores[1].num_blocks  # same memory, same cache


def test_a_missing_gpu_key_or_a_bad_model_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match=r"cluster\.0\.gpu\.GpuMapping\.bandwidth_gb_s"):
        load_scenario(_write(tmp_path, "{name: a, model: llama-3-8b, gpu: {peak_tflops: 500, "
                                       "memory_gib: 80}}"))
    (tmp_path / "m.json").write_text('{"hidden_size": 4096}')
    with pytest.raises(ScenarioError, match=r"m.json: config.json lacks \['num_hidden_layers'"):
        load_scenario(_write(tmp_path, "{name: a, gpu: h100, model: m.json}"))
    with pytest.raises(ScenarioError, match="unknown GPU 'b200'"):
        load_scenario(_write(tmp_path, "{name: a, gpu: b200, model: llama-3-8b}"))
