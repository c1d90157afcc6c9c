"""Trace formats: each read from a small sample written for the test, and replayed in a scenario."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llmflow.sim.scenario import Scenario, ScenarioError, load_scenario
from llmflow.sim.traces import TraceError, detect_format, read_trace
from llmflow.sim.workload import build_requests

DATA = Path(__file__).resolve().parent / "data"
TRACES = Path(__file__).resolve().parents[2] / "sim" / "traces"


def _scenario(arrival: dict[str, Any], **wc: Any) -> Scenario:
    return Scenario.model_validate({
        "title": "t", "seed": 3, "duration_s": 1000, "base_dir": DATA,
        "cluster": [{"name": "h", "gpu": "h100", "model": "llama-3-8b"}],
        "workload": [{"name": "c", "tenant": "t", "arrival": arrival, **wc}]})


def test_every_sample_is_detected_by_extension_and_header() -> None:
    assert detect_format(DATA / "mooncake_sample.jsonl") == "mooncake"
    assert detect_format(DATA / "vllm_bench_sample.json") == "vllm-bench"
    assert detect_format(DATA / "burstgpt_sample.csv") == "burstgpt"
    assert detect_format(TRACES / "azure2023_code.csv") == "csv"


def test_azure_csv_still_reads_times_and_lengths() -> None:
    raw = read_trace(TRACES / "azure2023_conv.csv")
    assert raw["prompt"][:2].tolist() == [374, 396]  # the file's first two rows
    assert raw["output"][:2].tolist() == [44, 109]
    assert raw["t"][1] == pytest.approx(50.9951690 - 46.6805900)


def test_mooncake_jsonl_times_in_ms_lengths_and_hash_ids() -> None:
    r = build_requests(_scenario({"kind": "trace", "path": "mooncake_sample.jsonl"}))
    # sorted by timestamp (ms -> s); the blank line is skipped
    assert r.t.tolist() == [0.0, 0.0, 3.15, 27.482, 30.0]
    assert r.prompt.tolist() == [6955, 6472, 512, 1300, 700]
    assert r.eos.tolist() == [52, 26, 8, 380, 14]
    assert r.hash_ids is not None
    assert r.hash_ids[0] == tuple(range(46, 60))
    assert r.hash_ids[2] == (0,)
    assert r.hash_ids[3] is None  # that line has no hash_ids
    assert r.hash_ids[4] == (46, 47)


def test_vllm_bench_json_arrivals_from_start_times() -> None:
    r = build_requests(_scenario({"kind": "trace", "path": "vllm_bench_sample.json"}))
    # start_times 1051.25, 1051.75, 1052.5, 1051.5 -> from the first, in order
    assert r.t.tolist() == [0.0, 0.25, 0.5, 1.25]
    assert r.prompt.tolist() == [1000, 900, 200, 1500]
    assert r.eos.tolist() == [100, 250, 300, 50]
    assert r.hash_ids is None


def test_vllm_bench_json_without_times_uses_the_rate() -> None:
    burst = build_requests(_scenario({"kind": "trace", "path": "vllm_bench_no_times.json"}))
    assert burst.t.tolist() == [0.0, 0.0, 0.0]  # request_rate "inf": all sent at once
    assert burst.eos.tolist() == [64, 1, 64]  # a failed request (0 tokens) still arrives
    paced = build_requests(_scenario({"kind": "trace", "path": "vllm_bench_no_times.json",
                                      "rate_per_s": 2.0}))
    assert np.all(np.diff(paced.t) > 0)
    assert paced.t[0] > 0


def test_burstgpt_csv_seconds_and_token_columns() -> None:
    r = build_requests(_scenario({"kind": "trace", "path": "burstgpt_sample.csv"}))
    assert r.t.tolist() == [0.0, 7.0, 40.0, 113.0]  # Timestamp 5, 12, 45, 118
    assert r.prompt.tolist() == [472, 1500, 1087, 417]
    assert r.eos.tolist() == [18, 250, 1, 276]  # a failed request's 0 becomes 1


def test_explicit_format_and_empirical_lengths_from_any_format() -> None:
    sc = _scenario({"kind": "poisson", "rate_per_s": 1.0},
                   prompt_tokens={"kind": "empirical", "path": "burstgpt_sample.csv",
                                  "column": "Request tokens", "format": "burstgpt"},
                   output_tokens={"kind": "empirical", "path": "mooncake_sample.jsonl",
                                  "column": "output"})
    r = build_requests(sc)
    assert set(r.prompt.tolist()) <= {472, 1500, 1087, 417}
    assert set(r.eos.tolist()) <= {52, 26, 8, 380, 14}


def test_unknown_or_broken_files_say_what_to_fix(tmp_path: Path) -> None:
    odd = tmp_path / "odd.csv"
    odd.write_text("when,how_long\n1,2\n")
    with pytest.raises(TraceError, match=r"unknown trace header \['when', 'how_long'\].*format"):
        read_trace(odd)
    lines = tmp_path / "bad.jsonl"
    lines.write_text('{"timestamp": 1, "input_length": 5}\n')
    with pytest.raises(TraceError, match=r"bad.jsonl:1: missing 'output_length'"):
        read_trace(lines)
    summary = tmp_path / "summary.json"
    summary.write_text('{"completed": 3, "mean_ttft_ms": 5}')
    with pytest.raises(TraceError, match="--save-detailed"):
        read_trace(summary)
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(tmp_path / "missing.csv")


def test_a_bad_format_key_is_named(tmp_path: Path) -> None:
    f = tmp_path / "s.yaml"
    f.write_text("title: x\nduration_s: 10\ncluster: [{name: a, gpu: h100, model: llama-3-8b}]\n"
                 "workload: [{name: c, tenant: t, arrival: {kind: trace, path: t.csv, "
                 "format: parquet}}]\n")
    with pytest.raises(ScenarioError, match=r"workload\.0\.arrival\.format"):
        load_scenario(f)


def test_an_append_result_file_replays_its_first_run(tmp_path: Path) -> None:
    runs = tmp_path / "runs.json"  # `vllm bench serve --append-result`: one JSON object a line
    runs.write_text('{"input_lens": [5, 6], "output_lens": [1, 2], "start_times": [3.0, 4.5]}\n'
                    '{"input_lens": [7], "output_lens": [1], "start_times": [9.0]}\n')
    raw = read_trace(runs)
    assert (raw["t"].tolist(), raw["prompt"].tolist()) == ([0.0, 1.5], [5, 6])
