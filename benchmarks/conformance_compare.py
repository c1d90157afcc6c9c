"""`llmflow conformance` against llmflow and vllm-router 0.1.17, in one run, side by side.

Each arm: `llmflow conformance` starts (its fake vLLM on a free port), then the gateway under
test is started in front of that port with the same claims, a cap of 4 and a queue of 8:

- llmflow: `llmflow serve` with `gate: {max_concurrency_per_gpu: 4, queue: {max_waiting: 8,
  follow_drain: false}, headroom_quantile: null}`, the stall cut at 1 s, three tenants (normal,
  vip, batch) by key;
- vllm-router 0.1.17 from PyPI, in the venv the gateway benchmark installs
  (`gatewaybench/procs.py:ensure_router`), started as the benchmark starts it
  (`--policy round_robin`) plus `--max-concurrent-requests 4 --queue-size 8`. It has no client
  keys or tiers, so its VIP row is n/a.

The suite runs with `--max-concurrency 4 --stall-within 5` for both (and the keys for llmflow).
Prints each arm's table and a side-by-side markdown table (the one in docs/gateway.md); the
JSON reports go to `--out` (default /tmp/conformance-compare).

Usage (from the repository's root):
    python -m benchmarks.conformance_compare [--out DIR] [--no-router]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.conformance import llmflow_config
from tests.processes import free_port

from benchmarks.gatewaybench.procs import ROUTER_VERSION, Proc, ensure_router, spawn, wait_http

KEYS = {"normal": "k-cmp-normal-4b1e", "vip": "k-cmp-vip-a07c", "batch": "k-cmp-batch-3d92"}
SUITE = ("--max-concurrency", "4", "--stall-within", "5")

if TYPE_CHECKING:
    from collections.abc import Callable

    Gateway = Callable[[int, int, Path], Proc]  # (port, backend port, log dir) -> started


def llmflow_gateway(port: int, backend_port: int, logdir: Path) -> Proc:
    """`llmflow serve` with a cap of 4 and a queue of 8, in front of the suite's backend."""
    config = llmflow_config(backend_port, KEYS)
    path = logdir / "llmflow.yaml"
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    cmd = [sys.executable, "-m", "llmflow.cli", "serve", "--config", str(path), "--port",
           str(port), "--log-level", "warning"]
    proc = spawn("llmflow", cmd, port, None, logdir)
    wait_http(proc, "/readyz")
    return proc


def router_gateway(port: int, backend_port: int, logdir: Path) -> Proc:
    """vllm-router with a cap of 4 and a queue of 8, in front of the suite's backend."""
    cmd = [str(ensure_router()), "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", f"http://127.0.0.1:{backend_port}", "--policy", "round_robin",
           "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1",
           "--max-concurrent-requests", "4", "--queue-size", "8"]
    proc = spawn("router", cmd, port, None, logdir)
    wait_http(proc, "/health")
    return proc


def run_arm(name: str, start: Gateway, extra: tuple[str, ...], out: Path) -> dict[str, Any]:
    """Start the suite (told the gateway's port ahead), then the gateway; wait for the suite;
    return its JSON report."""
    backend_port, port = free_port(), free_port()
    report, log = out / f"{name}.json", out / f"{name}.txt"
    command = [sys.executable, "-m", "llmflow.cli", "conformance", f"http://127.0.0.1:{port}",
               "--backend-port", str(backend_port), "--json", str(report), *SUITE, *extra]
    gateway = None
    with log.open("wb") as sink:
        suite = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
        try:
            time.sleep(1.0)  # the suite's backend listens within a second
            gateway = start(port, backend_port, out)
            suite.wait(timeout=600)
        finally:
            if suite.poll() is None:
                suite.kill()
            if gateway is not None:
                gateway.stop()
    print(log.read_text())
    return dict(json.loads(report.read_text()))


def main() -> int:
    """Run both arms and print the side-by-side table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/conformance-compare"))
    parser.add_argument("--no-router", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    keys = ("--api-key", KEYS["normal"], "--vip-key", KEYS["vip"], "--batch-key", KEYS["batch"])
    arms = {"llmflow": run_arm("llmflow", llmflow_gateway, keys, args.out)}
    if not args.no_router:
        name = f"vllm-router {ROUTER_VERSION}"
        arms[name] = run_arm("vllm-router", router_gateway, (), args.out)
    print(side_by_side(arms))
    return 0


def side_by_side(arms: dict[str, dict[str, Any]]) -> str:
    """A markdown table: one row per invariant, one column per gateway."""
    names = list(arms)
    lines = ["| invariant | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    first = arms[names[0]]["rows"]
    for i, row in enumerate(first):
        cells = []
        for name in names:
            other = arms[name]["rows"][i]
            cells.append(f"**{other['status'].upper()}**: {other['measured']}")
        lines.append(f"| {row['invariant']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
