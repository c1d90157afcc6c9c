"""Core throughput benchmark: Rust, PyO3 and the pure-Python reference model in one run.

One request cycle = submit, admit, first token, 10 token-chunk observations, finish; the runtime
rows run the same cycle through the whole lifecycle (arrive, started, 10 token events, done,
with every action it answers built).
Run: `python -m benchmarks.core_bench` (it builds and runs `cargo bench --bench cycle` too).
Prints a Markdown table for docs/benchmarks.md; ratios are to the reference model measured in
the same run, since these machines are noisy.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from property_tests.models import ReferenceGovernor, Req
from property_tests.strategies import policy_config
from tqdm import tqdm

from llmflow import Governor
from llmflow._core import Runtime

ROOT = Path(__file__).resolve().parent.parent


def config() -> dict[str, object]:
    c = policy_config(max_waiting=200, per_gpu=16, gpus=(1,))
    c.update(ttft_sla_ms=1500.0, preemption_cooldown_ms=10000.0)
    return c


def pyo3_cycles(n: int) -> float:
    g = Governor(config())
    submit, first, tokens, finish = g.submit, g.on_first_token, g.on_tokens, g.finish
    start = time.perf_counter()
    for rid in range(n):
        now = rid * 10
        submit(rid, "n1", 512, 256, now)
        first(rid, now + 1)
        for _ in range(10):
            tokens(rid, 1, now + 2)
        finish(rid, "completed", now + 3)
    return n / (time.perf_counter() - start)


def pyo3_runtime_cycles(n: int) -> float:
    rt = Runtime({"policy": config(), "lifecycle": {"stall_timeout_ms": 30000.0}})
    arrive, started, tokens, done = rt.arrive, rt.started, rt.tokens, rt.done
    start = time.perf_counter()
    for rid in range(n):
        now = rid * 10
        arrive(rid, "n1", 512, 256, True, now)
        started(rid, now + 1)
        for _ in range(10):
            tokens(rid, 1, now + 2)
        done(rid, now + 3)
    return n / (time.perf_counter() - start)


def reference_cycles(n: int) -> float:
    model = ReferenceGovernor(config())
    start = time.perf_counter()
    for rid in range(n):
        kind, detail = model.decide("n1", 512, 256, rid * 10)
        backend = detail if kind == "admitted" else None
        req = model.live[rid] = Req("n1", 1, 512, backend=backend)
        for _ in range(10):
            req.generated += 1
            model.ledger()
        del model.live[rid]
    return n / (time.perf_counter() - start)


def rust_results() -> list[dict[str, float]]:
    out = subprocess.run(
        ["cargo", "bench", "--bench", "cycle", "--no-default-features", "--quiet"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def main() -> int:
    steps = tqdm(total=4, desc="core bench", unit="stage")
    ref = reference_cycles(20_000)
    steps.update()
    py = pyo3_cycles(200_000)
    steps.update()
    py_runtime = pyo3_runtime_cycles(200_000)
    steps.update()
    rust = rust_results()
    steps.update()
    steps.close()
    rust_cycles = next(r["value"] for r in rust if r["measure"] == "rust_cycles_per_s")
    rust_runtime = next(r["value"] for r in rust if r["measure"] == "rust_runtime_cycles_per_s")
    print("| path | cycles/s | ratio to Python reference |")
    print("|---|---:|---:|")
    for name, value in [("Python reference model", ref), ("PyO3 from Python", py),
                        ("pure Rust", rust_cycles), ("runtime, PyO3 from Python", py_runtime),
                        ("runtime, pure Rust", rust_runtime)]:
        print(f"| {name} | {value:,.0f} | {value / ref:.1f}x |")
    print()
    print("| queued | submit + cancel (ns) | finish + dispatch + submit (ns) |")
    print("|---:|---:|---:|")
    for r in rust:
        if r["measure"] == "decision_ns":
            print(f"| {r['queued']:,} | {r['submit_cancel_ns']:.0f} | "
                  f"{r['finish_dispatch_submit_ns']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
