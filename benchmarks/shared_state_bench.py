"""What the shared state in Redis adds to each request's latency.

A real `llmflow simserve` (fast: `--speed 50`) behind a real `llmflow serve`, once with the
default in-memory state and once with `state: {backend: redis}` on a real `redis-server` on
loopback. One client sends `--requests` small streamed chat completions one after another
(so nothing queues and the difference is the Redis path: the lease script before the start,
the release after the end) and records each request's time to its last byte. The two runs
alternate in `--rounds` blocks so drift on a shared machine hits both alike.

Also times the lease scripts alone (acquire, then release) from a Python `redis.asyncio`
client: the floor of what the gateway's path can cost.

Usage: `python -m benchmarks.shared_state_bench [--requests 200] [--rounds 3] [--json OUT]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from tests.processes import GatewayProcess, RedisProcess, SimServeProcess

MODEL = "bench"


def _config(backend: str, redis_url: str | None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "gate": {"max_concurrency_per_gpu": 64},
        "streaming": {"sse_flush_interval": 0},
        "sla": {"ttft_ms": None},
        "backends": [{"name": "b0", "url": backend, "models": [MODEL]}],
    }
    if redis_url is not None:
        config["state"] = {"backend": "redis", "url": redis_url, "replicas": 1}
    return config


async def _one(client: httpx.AsyncClient) -> float:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": 4,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        async for _ in r.aiter_raw():
            pass
        assert r.status_code == 200, r.status_code
    return time.perf_counter() - t0


async def _run(url: str, n: int) -> list[float]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        for _ in range(10):  # warm the connection and the gateway
            await _one(client)
        return [await _one(client) for _ in range(n)]


async def _scripts(redis_url: str, n: int) -> list[float]:
    import redis.asyncio as aioredis

    from llmflow.gateway.shared_state import _ACQUIRE

    client = aioredis.from_url(redis_url)
    acquire = client.register_script(_ACQUIRE)
    out = []
    try:
        for i in range(n + 10):
            t0 = time.perf_counter()
            assert await acquire(keys=["bench:slots"], args=[f"lease-{i}", 10_000, 64]) == 1
            await client.zrem("bench:slots", f"lease-{i}")
            if i >= 10:
                out.append(time.perf_counter() - t0)
    finally:
        await client.aclose()
    return out


def _pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] * 1e3 if q < 100 else 0.0


def main() -> None:
    """Run the benchmark and print a table (milliseconds)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per block")
    ap.add_argument("--rounds", type=int, default=3, help="alternating blocks per config")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    times: dict[str, list[float]] = {"memory": [], "redis": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with (
            RedisProcess(work / "redis") as redis_server,
            SimServeProcess(work, "--model-name", MODEL, "--speed", "50") as backend,
        ):
            gws = {
                "memory": GatewayProcess(_config(backend.url, None), work / "mem").start(),
                "redis": GatewayProcess(_config(backend.url, redis_server.url), work / "r").start(),
            }
            try:
                for _ in range(args.rounds):
                    for name, gw in gws.items():
                        times[name] += asyncio.run(_run(gw.url, args.requests))
            finally:
                for gw in gws.values():
                    gw.stop()
            scripts = asyncio.run(_scripts(redis_server.url, args.requests * args.rounds))
    figures = {
        name: {"p50_ms": _pct(xs, 50), "p99_ms": _pct(xs, 99), "n": len(xs)}
        for name, xs in (*times.items(), ("lease scripts alone", scripts))
    }
    for q in ("p50_ms", "p99_ms"):
        figures.setdefault("added by redis", {})[q] = figures["redis"][q] - figures["memory"][q]
    print(f"{'path':<22} {'p50 ms':>8} {'p99 ms':>8}")
    for name, f in figures.items():
        print(f"{name:<22} {f['p50_ms']:>8.3f} {f['p99_ms']:>8.3f}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
