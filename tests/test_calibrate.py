"""`llmflow calibrate` against a backend whose true step cost is known: the simulated vLLM.

`llmflow simserve` runs the roofline engine model in real time behind vLLM's HTTP API, so the
profile `calibrate` fits from it can be checked against the cost model that produced the
timings. The server runs at a quarter speed (each step lasts four times as long in wall time),
so scheduling jitter on a busy machine is small next to the steps being measured.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import httpx
import pytest

from llmflow.calibrate import Calibration
from llmflow.calibrate.measure import _fit_to_limits
from llmflow.cli import main
from llmflow.sim.costmodel import cost_model
from llmflow.sim.profile import Profile, StepModel, load_profile
from tests.processes import free_port

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

SPEED = 0.25  # simulated seconds per wall second: steps of 26 ms and more, jitter is small
TOLERANCE = 0.25  # relative: the roofline's kinks are not linear, timing on shared cores is noisy


@pytest.fixture(scope="module")
def simserve() -> Iterator[str]:
    """`llmflow simserve` (H100, Llama-3-8B, quarter speed) in a child process; its base URL."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmflow.cli", "simserve", "--preset", "h100:llama-3-8b",
         "--speed", str(SPEED), "--port", str(port), "--max-num-seqs", "16",
         "--max-model-len", "4096"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **_own_group())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, "simserve exited"
            assert time.monotonic() < deadline, "simserve did not start"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _own_group() -> dict[str, object]:
    return {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}


@pytest.mark.slow
def test_calibrate_recovers_the_simulated_engines_costs(simserve: str, tmp_path: Path) -> None:
    out = tmp_path / "profile.yaml"
    status = main(["calibrate", "--backend", simserve, "--out", str(out), "--no-progress",
                   "--prompt-lengths", "64,512,1024,2048", "--repeats", "2",
                   "--concurrency", "1,4,16", "--contexts", "64,1024", "--decode-tokens", "24",
                   "--decode-repeats", "1", "--mixed-prompts", "1024", "--max-num-seqs", "16"])
    assert status == 0
    profile = load_profile(out)
    assert profile.model == "llama-3-8b"
    assert profile.engine == {"block_size": 16, "num_gpu_blocks": profile.engine["num_gpu_blocks"],
                              "max_model_len": 4096, "max_num_seqs": 16}
    assert len(profile.measurements["prefill"]) == 8
    assert len(profile.measurements["decode"]) == 6
    assert len(profile.measurements["mixed"]) == 2
    true, fit = cost_model("h100", "llama-3-8b"), profile.step_s
    for prompt in (1024, 2048):  # an idle first token: one prefill step (compute-bound here)
        truth = true.step_time(0, 0, prompt, prompt * prompt, prompt, 0.0) / SPEED
        fitted = profile.frontend_s + fit.step_time(prompt, prompt * prompt, 0, 0)
        assert fitted == pytest.approx(truth, rel=TOLERANCE), prompt
    for batch in (1, 16):  # a decode step of the whole batch at about 1,080 tokens of context
        ctx = batch * 1080
        truth = true.step_time(batch, ctx, 0, 0, 0, 0.0) / SPEED
        assert fit.step_time(0, 0, batch, ctx) == pytest.approx(truth, rel=TOLERANCE), batch
    assert profile.frontend_s < 0.02  # HTTP on loopback, nothing like a 10 ms+ step


def test_calibrate_reports_an_unreachable_backend(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["calibrate", "--backend", url, "--out", str(tmp_path / "p.yaml"),
                 "--no-progress"]) == 1
    assert not (tmp_path / "p.yaml").exists()


def test_probes_are_trimmed_one_by_one_to_the_kv_blocks() -> None:
    # the KV-starved vLLM-CPU: 32 blocks of 128 tokens, block 0 never handed out, probes held to
    # 90% of the 31 others (27.9 blocks) so that none is preempted
    cal = Calibration("http://x", prompt_lengths=(16, 1536, 1984), concurrency=(1, 2, 4, 8, 16),
                      contexts=(32, 320, 640, 896, 2000), mixed_prompts=(768, 2304))
    _fit_to_limits(cal, {"max_model_len": 2048, "block_size": 128, "num_gpu_blocks": 32})
    assert cal.prompt_lengths == (16, 1536)  # 1984 + 64 new tokens is past max_model_len
    assert cal.mixed_prompts == (768,)  # 7 blocks + the batch's 8
    # each (context, batch) on its own: 16 x 1 block, 8 x 3 blocks, 4 x 6, 2 x 8 (4 x 8 is 32)
    assert cal.decode_batches() == ((32, 1), (32, 2), (32, 4), (32, 8), (32, 16),
                                    (320, 1), (320, 2), (320, 4), (320, 8),
                                    (640, 1), (640, 2), (640, 4), (896, 1), (896, 2))
    assert cal.probes() == 2 * 3 + 2 * (31 + 15 + 7 + 3) + 1 * 3 * 9  # requests, 3 repeats
    big = Calibration("http://x", concurrency=(1, 16), contexts=(32, 1280))
    _fit_to_limits(big, {"max_model_len": 4096})  # no cache figure: every pair
    assert big.decode_batches() == ((32, 1), (32, 16), (1280, 1), (1280, 16))


def test_refit_fits_a_stored_profile_again_from_its_measurements(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    true = StepModel(overhead=2e-3, prefill_token=10e-6, prefill_attn=5e-9, decode_seq=50e-6,
                     decode_ctx=100e-9, mixed_prefill=12e-6)
    raw = {
        "prefill": [{"prompt_tokens": n, "ttft_s": 0.007 + true.step_time(n, n * n, 0, 0)}
                    for n in (16, 256, 768, 1536)],
        "decode": [{"concurrency": b, "prompt_tokens": c, "decode_ctx": b * (c + 32),
                    "itl_s": true.step_time(0, 0, b, b * (c + 32))}
                   for b in (1, 4) for c in (32, 640)],
        "mixed": [{"decodes": 8, "decode_ctx": 800, "prompt_tokens": n,
                   "step_s": true.step_time(n, n * n, 8, 800)} for n in (128, 768)],
    }
    old = tmp_path / "old.yaml"  # an older fit's terms and a gateway hop added to its frontend
    Profile(step_s=StepModel(overhead=1e-3, mixed_prefill=30e-6), frontend_s=0.009,
            fit={"gateway_hop_s": 0.002}, measurements=raw).dump(old)
    new = tmp_path / "new.yaml"
    assert main(["calibrate", "--refit", str(old), "--out", str(new)]) == 0
    assert "per request" in capsys.readouterr().out
    profile = load_profile(new)
    for name, value in true.model_dump().items():
        assert getattr(profile.step_s, name) == pytest.approx(value, rel=1e-6), name
    assert profile.frontend_s == pytest.approx(0.007 + 0.002)  # the hop is kept
    assert profile.fit["gateway_hop_s"] == 0.002
    assert profile.measurements == load_profile(old).measurements
    (tmp_path / "bad.yaml").write_text("step_s: {overhead: -1}\n")
    assert main(["calibrate", "--refit", str(tmp_path / "bad.yaml"), "--out", str(new)]) == 1
    assert "invalid profile" in capsys.readouterr().err
