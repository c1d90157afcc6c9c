"""The engine model against vLLM's own V1 `Scheduler`, step by step, where KV blocks are short.

`vllm_scheduler.py` drives the installed vLLM's `Scheduler` with no model (one sampled token
whenever a request's scheduled tokens reach its end); the simulator's `EngineCore` runs the same
requests. Both give, per step, running and waiting after it, preemptions while planning it and
tokens scheduled; the two logs must be equal. The stored case is the one
`tests/sim/test_engine_starved.py` checks without vLLM; the drawn one is new each run.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.sim.test_engine_starved import engine_log

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
STORED = HERE.parent / "sim" / "data" / "vllm_scheduler_sharegpt_starved.json"


def _engine_log(case: dict[str, Any]) -> list[list[int]]:
    log = engine_log(case["engine"], [tuple(r) for r in case["requests"]], checked=False)
    return [[r.running, r.waiting, len(r.preempted), r.decodes + r.prefill_tokens] for r in log]


def _vllm_log(python: Path, model: Path, case: dict[str, Any], tmp: Path) -> list[list[int]]:
    path = tmp / "case.json"
    path.write_text(json.dumps(case), encoding="utf-8")
    proc = subprocess.run([str(python), str(HERE / "vllm_scheduler.py"), str(model), str(path)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)["steps"]


def _drawn_case(seed: int) -> dict[str, Any]:
    # ShareGPT-like lengths (long-tailed prompts and outputs), arrivals every 2 steps on
    # average, a KV cache a tenth of what the requests need at once
    rng = random.Random(seed)
    reqs, t = [], 0.0
    for _ in range(50):
        prompt = min(900, max(1, int(rng.lognormvariate(5.3, 1.0))))
        out = min(1000 - prompt, max(1, int(rng.lognormvariate(5.0, 0.9))))
        reqs.append([int(t), prompt, out])
        t += rng.expovariate(0.5)
    return {"engine": {"num_gpu_blocks": 121, "block_size": 16, "max_num_seqs": 32,
                       "max_num_batched_tokens": 384, "max_model_len": 1024, "watermark": 0.02},
            "requests": reqs}


@pytest.mark.timeout(600)
def test_engine_steps_equal_vllm_schedulers(
    vllm_python: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Every step of both logs equal, on the stored case and a freshly drawn one."""
    stored = json.loads(STORED.read_text(encoding="utf-8"))
    seed = random.randrange(1 << 30)
    for name, case in (("stored", stored), (f"drawn, seed {seed}", _drawn_case(seed))):
        theirs = _vllm_log(vllm_python, tiny_model_dir, case, tmp_path)
        ours = _engine_log(case)
        preemptions = sum(r[2] for r in theirs)
        print(f"\n{name}: {len(theirs)} steps, {preemptions} preemptions, peak running "
              f"{max(r[0] for r in theirs)} (vLLM) / {max(r[0] for r in ours)} (engine)",
              file=sys.stderr)
        assert preemptions > 0, name  # the case does starve the cache
        pairs = enumerate(zip(ours, theirs, strict=False))
        first = next((i for i, (a, b) in pairs if a != b), None)
        assert first is None, (name, first, ours[first], theirs[first])
        assert len(ours) == len(theirs), name
