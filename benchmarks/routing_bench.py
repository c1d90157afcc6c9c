"""Routing cost: a governor's submit + finish under each routing policy, and the gateway's
prompt hashing for a `prefix` pool.

Run: `python -m benchmarks.routing_bench`. Prints a Markdown table for docs/benchmarks.md. Eight
backends with KV known, one tier; every request carries a 300-block hash chain (a 4,800-token
prompt at 16 tokens a block) and ends at once, so each cycle routes against an idle cluster and
`prefix` matches and remembers the whole chain.
"""

from __future__ import annotations

import time

from llmflow import Governor
from llmflow.gateway.prefix import chain_hashes

CHAIN = list(range(300))
POLICIES = ("free_slots", "round_robin", "least_loaded", "prefix")


def config(policy: str) -> dict[str, object]:
    return {
        "backends": [{"name": f"b{i}", "gpus": 1, "kv_blocks": 10_000} for i in range(8)],
        "max_concurrency_per_gpu": 64,
        "max_waiting": 100_000,
        "tiers": [{"name": "t"}],
        "tenants": [{"name": "a", "tier": "t"}],
        "routing": {"policy": policy},
    }


def cycle_us(policy: str, n: int = 20_000) -> float:
    g = Governor(config(policy))
    submit, finish = g.submit, g.finish
    start = time.perf_counter()
    for rid in range(n):
        submit(rid, "a", 4800, 100, rid, prefix_hashes=CHAIN)
        finish(rid, "completed", rid)
    return (time.perf_counter() - start) / n * 1e6


def hashing_us(size: int, n: int = 2_000) -> float:
    data = ("You are a helpful assistant. " * (size // 29 + 1)).encode()[:size]
    start = time.perf_counter()
    for _ in range(n):
        chain_hashes(data, 64)
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    print("| what | µs |\n|---|---:|")
    for policy in POLICIES:
        print(f"| submit + finish, `{policy}` | {cycle_us(policy):.2f} |")
    for size in (1_000, 10_000, 100_000):
        print(f"| gateway prefix hashes, {size:,}-byte prompt | {hashing_us(size):.1f} |")


if __name__ == "__main__":
    main()
