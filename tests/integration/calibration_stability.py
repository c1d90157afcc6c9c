"""Calibrate one KV-starved vLLM-CPU several times and compare the fitted step terms.

The stability check of docs/fidelity.md ("Fitting the step costs"): one vLLM with
`--kv-cache-memory-bytes 4 MiB` (the KV-starved test's server), warmed up with a draw of the
starved burst, then calibrated `--rounds` times with each sweep named, the sweeps alternating so
that a drift of the host's load hits them alike. `old` is the sweep the KV-starved test used
before the staged fit (first tokens to 768, decodes at 32 and 384 tokens of context, one mixed
prompt size, one or two repeats); `new` is the test's `STARVED_SWEEP`. Every profile is written
to OUT as `<sweep>-<round>.yaml` (raw measurements included, so any fit can be redone) and a
table of the terms is printed, each with its relative standard error.

`--joins` measures instead what a prompt adds to a decoding batch at several batch shapes (the
calibration's mixed probe with 8, 8, 4 and 2 decoders of 32, 160, 544 and 800-token prompts,
prompts of 128, 384 and 768 tokens joining, `--rounds` times each) and writes the samples to
OUT/joins.json: whether that cost grows with the prompt, the decodes or their context.

Run from the repo root, with the project's python (one vLLM, about 2 minutes on 2 cores)::

    LLMFLOW_VLLM_PYTHON=$(scripts/vllm_env.sh | tail -1) PYTHONPATH=$PWD:$PWD/python:$PWD/tests:\
$PWD/tests/integration python tests/integration/calibration_stability.py OUT --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

import fidelity
from cpu import pinned, spare_cpus
from gwtools import wait_vllm_idle
from test_fidelity import ENGINE, STARVED_ARGS, STARVED_SWEEP
from vllm_server import tiny_vllm

from llmflow.calibrate import Calibration, calibrate, measure
from llmflow.gateway.http1 import ConnectionPool
from llmflow.sim.profile import STEP_TERMS, MixedSample, Profile

HERE = Path(__file__).resolve().parent
SWEEPS = {
    "old": {"prompt_lengths": (16, 128, 384, 768), "repeats": 2, "concurrency": (1, 4, 8),
            "contexts": (32, 384), "decode_repeats": 1, "mixed_prompts": (256,)},
    "new": STARVED_SWEEP,
}
UNITS = {"overhead": 1e3, "prefill_token": 1e6, "prefill_attn": 1e9, "decode_seq": 1e6,
         "decode_ctx": 1e9, "mixed_prefill": 1e6, "frontend": 1e3}  # ms, us, ns/unit, us, ns


# (decoders, their prompt tokens): each fits the 27.9 blocks with a 768-token prompt joining
JOIN_BATCHES = ((8, 32), (8, 160), (4, 544), (2, 800))
JOIN_PROMPTS = (128, 384, 768)


async def joins(url: str, decoders: int, context: int, rounds: int) -> list[MixedSample]:
    """The mixed probe with `decoders` requests of `context`-token prompts decoding."""
    measure._MIXED_CONTEXT = context  # the probe's batch prompt (a module constant)
    cal = Calibration(url, "tiny", repeats=rounds, mixed_prompts=JOIN_PROMPTS,
                      mixed_decodes=decoders)
    pool = ConnectionPool(connect_timeout_s=10.0)
    try:
        return await measure._Runner(cal, pool, "tiny", lambda n: None).mixed()
    finally:
        pool.close()


def row(name: str, profile: Profile) -> str:
    """One table line: each term in its unit, with its relative standard error."""
    values = {**profile.step_s.model_dump(), "frontend": profile.frontend_s}
    se = profile.fit.get("rel_stderr", {})
    cells = [f"{values[t] * UNITS[t]:.3g}" + (f" ±{se[t]:.0%}" if se.get(t) is not None else "")
             for t in (*STEP_TERMS, "frontend")]
    return f"| {name} | " + " | ".join(cells) + " |"


def main() -> None:
    """Calibrate the starved vLLM `--rounds` times per sweep; write and print the profiles."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sweeps", nargs="+", choices=sorted(SWEEPS), default=["old", "new"])
    ap.add_argument("--joins", action="store_true", help="time prompts joining decode batches")
    args = ap.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    lines = ["| calibration | overhead ms | prefill_token us | prefill_attn ns | decode_seq us | "
             "decode_ctx ns | mixed_prefill us | frontend ms |", "|---" * 8 + "|"]
    with tempfile.TemporaryDirectory() as tmp, tiny_vllm(Path(tmp), STARVED_ARGS) as server:
        assert server.process is not None
        sc = fidelity.load(Path(tmp) / "profile.yaml", fidelity.STARVED)
        with pinned(spare_cpus(server.process.pid)):
            asyncio.run(fidelity.replay(sc, server.url, seed=sc.seed + 1))  # warm-up
            samples = []
            for decoders, context in JOIN_BATCHES if args.joins else ():
                wait_vllm_idle(server)
                samples += [vars(m) for m in asyncio.run(
                    joins(server.url, decoders, context, args.rounds))]
            if args.joins:
                (out / "joins.json").write_text(json.dumps(samples, indent=1) + "\n")
                return
            for i in range(1, args.rounds + 1):
                for name in args.sweeps:
                    wait_vllm_idle(server)
                    cal = Calibration(server.url, engine=dict(ENGINE),
                                      **SWEEPS[name])  # type: ignore[arg-type]
                    profile = asyncio.run(calibrate(cal))
                    profile.dump(out / f"{name}-{i}.yaml")
                    lines.append(row(f"{name}-{i}", profile))
                    print(lines[-1], flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
