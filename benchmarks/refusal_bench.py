"""How fast `llmflow serve` refuses, and where a refused request's time goes.

A flood is answered with 429s; each one costs the gateway's one event loop some CPU, and the
loop's refusals per second bound how fast a burst is answered. This script measures that from
outside:

1. a backend that takes requests and never answers (an asyncio server in this process: its
   `/metrics` says all is well, its completions hold their slot for ever), behind a real
   `llmflow serve` with 4 slots and no waiting places, and 4 requests that fill the slots: from
   then on every request is refused (429 `queue_full`) by the runtime;
2. `--connections` keep-alive raw-socket clients send refused requests back to back for
   `--duration` seconds: refusals per second, latency percentiles, and the gateway's CPU
   seconds per refusal (`/proc/PID/stat`, so other work on the machine does not blur it);
3. with `--profile`, `py-spy record` on the gateway over a second window of the same load, and
   its stacks sorted into buckets by the innermost frame that names one (HTTP parsing, ASGI and
   FastAPI, validation, the runtime, the error reply, the event loop), printed as a table.

Usage: `python -m benchmarks.refusal_bench [--connections 32] [--duration 10] [--profile]
[--py-spy PATH] [--json OUT]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from tests.processes import GatewayProcess

_MODEL = "bench"
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PY_SPY = Path.home() / ".cache" / "llmflow" / "tools" / "venv" / "bin" / "py-spy"
# Buckets for py-spy stacks: the first pattern found in a frame, innermost frame first.
_BUCKETS = (
    ("runtime (Rust) arrive/refusal", ("arrive (llmflow/gateway/host.py", "refusal (")),
    ("validation: decode_json + pydantic", ("decode_json", "model_validate", "prepare (")),
    ("auth (SHA-256, compare)", ("authenticate (",)),
    ("session objects", ("StreamSession", "__init__ (llmflow/gateway/session.py")),
    ("error reply (JSONResponse, send)", ("response (llmflow/gateway/errors.py", "JSONResponse")),
    ("HTTP parsing (httptools callbacks)", ("httptools_impl.py", "guard.py")),
    ("starlette/fastapi routing, middleware", ("starlette/", "fastapi/", "middleware.py")),
    ("anyio / asyncio tasks", ("anyio/", "asyncio/")),
)


async def _hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            if not head.startswith(b"GET /metrics"):
                await asyncio.Event().wait()  # a completion: hold its slot for ever
            text = b"vllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0.0\n"
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(text) + text)
            await writer.drain()


def _config(url: str) -> dict[str, Any]:
    return {
        "gate": {"max_concurrency_per_gpu": 4, "queue": {"max_waiting": 0}},
        "sla": {"ttft_ms": None},
        "streaming": {"first_token_timeout_ms": None},
        "metrics": {"scrape_interval_ms": 1000},
        "server": {"drain_timeout_ms": 100},
        "tenants": [{"name": "crowd", "tier": "normal", "api_keys": ["k-crowd"]}],
        "backends": [{"name": "b0", "url": url, "models": [_MODEL], "max_model_len": 8192}],
    }


def _request() -> bytes:
    body = json.dumps(
        {"model": _MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    ).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\n"
        b"host: localhost\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer k-crowd\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    )


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


async def _client(port: int, stop: float, out: list[tuple[int, float]]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = _request()
    while time.perf_counter() < stop:
        start = time.perf_counter()
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
        out.append((int(head.split(b" ", 2)[1]), time.perf_counter() - start))
    writer.close()


async def _window(port: int, pid: int, connections: int, duration: float) -> dict[str, Any]:
    out: list[tuple[int, float]] = []
    cpu0, wall0 = _cpu_s(pid), time.perf_counter()
    stop = wall0 + duration
    await asyncio.gather(*(_client(port, stop, out) for _ in range(connections)))
    cpu, wall = _cpu_s(pid) - cpu0, time.perf_counter() - wall0
    refused = sorted(t for s, t in out if s == 429)
    statuses = Counter(s for s, _ in out)
    assert set(statuses) == {429}, statuses
    return {
        "refusals": len(refused),
        "refusals_per_s": round(len(refused) / wall, 1),
        "gateway_cpu_us_per_refusal": round(cpu / len(refused) * 1e6, 1),
        "gateway_cpu_share": round(cpu / wall, 2),
        "p50_ms": round(refused[len(refused) // 2] * 1e3, 2),
        "p99_ms": round(refused[int(0.99 * len(refused))] * 1e3, 2),
        "mean_ms": round(statistics.fmean(refused) * 1e3, 2),
    }


def _buckets(raw: str) -> dict[str, float]:
    counts: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        total += int(n)
        frames = stack.split(";")[::-1]  # innermost first
        bucket = next(
            (
                name
                for frame in frames
                for name, patterns in _BUCKETS
                if any(p in frame for p in patterns)
            ),
            "event loop, other" if "run_forever" in stack else "idle / other",
        )
        counts[bucket] += int(n)
    return {name: round(100 * n / total, 1) for name, n in counts.most_common()}


async def _profile(py_spy: Path, pid: int, port: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "stacks.txt"
        cmd = [str(py_spy), "record", "--pid", str(pid), "--rate", "250", "--duration"]
        cmd += [str(int(args.duration)), "--format", "raw", "-o", str(raw), "--nonblocking"]
        spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        await asyncio.sleep(1.0)  # py-spy attaches
        await _window(port, pid, args.connections, args.duration)
        _, err = spy.communicate(timeout=60)
        if not raw.exists():
            raise RuntimeError(f"py-spy failed: {err.decode(errors='replace')}")
        text = raw.read_text()
        if args.stacks:
            Path(args.stacks).write_text(text)
        return _buckets(text)


def _backend() -> str:
    """Serve `_hold` on a loop of its own (starting the gateway blocks this one)."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    started = asyncio.run_coroutine_threadsafe(asyncio.start_server(_hold, "127.0.0.1", 0), loop)
    server = started.result(timeout=10)
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    url = _backend()
    with tempfile.TemporaryDirectory() as tmp, GatewayProcess(_config(url), Path(tmp)) as gw:
        pid = gw.pid()
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
            body = {"model": _MODEL, "messages": [{"role": "user", "content": "hi"}]}
            headers = {"authorization": "Bearer k-crowd"}
            holders = [
                asyncio.create_task(client.post("/v1/chat/completions", json=body, headers=headers))
                for _ in range(4)
            ]
            while (await client.get("/api/state")).json()["core"]["running"] < 4:
                await asyncio.sleep(0.05)
            await _window(gw.port, pid, args.connections, 2.0)  # warm-up
            result: dict[str, Any] = {"connections": args.connections}
            result["window"] = await _window(gw.port, pid, args.connections, args.duration)
            if args.profile:
                result["profile_pct"] = await _profile(Path(args.py_spy), pid, gw.port, args)
            for task in holders:
                task.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
    return result


def main() -> None:
    """Run the benchmark and print its figures (JSON, then the profile as a table)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--connections", type=int, default=32, help="keep-alive clients (32)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per window (10)")
    p.add_argument("--profile", action="store_true", help="py-spy a second window")
    p.add_argument("--py-spy", default=str(_PY_SPY), help="the py-spy binary")
    p.add_argument("--stacks", help="also write py-spy's raw stacks here")
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args()
    result = asyncio.run(_main(args))
    print(json.dumps(result, indent=2))
    for name, pct in result.get("profile_pct", {}).items():
        print(f"| {name} | {pct} % |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
