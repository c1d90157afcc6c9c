"""Gateway overhead benchmark: added TTFT and chunk throughput, gateway vs a direct connection.

Three processes on loopback: a minimal vLLM-format streaming backend (this file, `--backend`),
the real gateway (`llmflow serve`), and this driver with raw-socket clients, so that neither
the backend nor the client costs more in one arm than in the other. Each phase runs the same
workload straight at the backend and then through the gateway, side by side in one run:

- TTFT: `--streams` concurrent closed-loop streams (first token after `--ttft-ms`, then
  `--tokens` tokens every `--itl-ms`); the added TTFT is gateway minus direct, per percentile.
- Throughput: the same number of streams with tokens back to back (no inter-token delay);
  chunks per second as the clients count `data:` events.

Usage: `python benchmarks/gateway_bench.py [--streams 256] [--duration 10] [--json OUT]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_MODEL = "bench"
_FIRST_TEXT = b'"content":"t'  # the first generated text, in both arms' compact JSON


# ---- backend: a vLLM-format SSE server with no framework in the way -----------------------


async def _backend_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            line, *headers = head.decode("latin-1").split("\r\n")
            length = next(
                (
                    int(h.split(":", 1)[1])
                    for h in headers
                    if h.lower().startswith("content-length:")
                ),
                0,
            )
            body = await reader.readexactly(length) if length else b""
            if line.startswith("GET /metrics"):
                text = b"vllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0.0\n"
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: "
                    + str(len(text)).encode()
                    + b"\r\n\r\n"
                    + text
                )
            else:
                await _stream(writer, json.loads(body))
            await writer.drain()
    writer.close()


async def _stream(writer: asyncio.StreamWriter, body: dict[str, Any]) -> None:
    plan = body.get("bench", {})
    tokens, ttft, itl = int(body.get("max_tokens", 16)), plan.get("ttft", 0.0), plan.get("itl", 0)
    usage = bool((body.get("stream_options") or {}).get("continuous_usage_stats"))
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    await asyncio.sleep(ttft)
    for i in range(tokens):
        finish = '"length"' if i == tokens - 1 else "null"
        extra = (
            (f',"usage":{{"prompt_tokens":8,"completion_tokens":{i + 1},"total_tokens":{i + 9}}}')
            if usage
            else ""
        )
        event = (
            f'data: {{"id":"chatcmpl-b","object":"chat.completion.chunk","created":1,'
            f'"model":"{_MODEL}","choices":[{{"index":0,"delta":{{"content":"t{i} "}},'
            f'"logprobs":null,"finish_reason":{finish}}}]{extra}}}\n\n'
        ).encode()
        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        if itl:
            await asyncio.sleep(itl)
        elif i % 16 == 15:
            await writer.drain()
    done = b"data: [DONE]\n\n"
    writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))


async def _serve_backend(port: int) -> None:
    server = await asyncio.start_server(_backend_conn, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


# ---- client: raw sockets, counting events ------------------------------------------------


class _Conn:
    """One keep-alive client connection (as the `openai` client keeps its own)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def stream(self, payload: bytes) -> tuple[float, int]:
        """Send one streamed request; (seconds to the first token, SSE events received)."""
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        assert self.reader is not None
        start = time.perf_counter()
        self.writer.write(payload)
        ttft, events, tail, done = -1.0, 0, b"", False
        while True:
            data = await self.reader.read(65536)
            if not data:
                self.writer = None
                break
            window = tail + data
            if ttft < 0 and _FIRST_TEXT in window:
                ttft = time.perf_counter() - start
            events += window.count(b"data: ") - tail.count(b"data: ")
            done = done or b"data: [DONE]" in window
            if done and window.endswith(b"0\r\n\r\n"):  # the chunked body's end
                break
            tail = window[-16:]
        return ttft, events


def _request(port: int, tokens: int, ttft_s: float, itl_s: float) -> bytes:
    body = json.dumps(
        {
            "model": _MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": tokens,
            "stream": True,
            "bench": {"ttft": ttft_s, "itl": itl_s},
        }
    ).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % (port, len(body))
    ) + body


async def _load(port: int, streams: int, duration: float, payload: bytes) -> dict[str, Any]:
    ttfts: list[float] = []
    chunks = 0
    stop = time.perf_counter() + duration

    async def worker() -> None:
        nonlocal chunks
        conn = _Conn(port)
        while time.perf_counter() < stop:
            ttft, events = await conn.stream(payload)
            if ttft >= 0:
                ttfts.append(ttft)
            chunks += events

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(streams)))
    wall = time.perf_counter() - started
    ttfts.sort()
    return {
        "requests": len(ttfts),
        "chunks": chunks,
        "wall_s": round(wall, 3),
        "chunks_per_s": round(chunks / wall),
        "ttft_ms": _percentiles(ttfts),
    }


def _percentiles(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        only = round(values[0] * 1e3, 3) if values else float("nan")
        return {"p50": only, "p99": only}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": round(q[49] * 1e3, 3), "p99": round(q[98] * 1e3, 3)}


# ---- orchestration -------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, path: bytes, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1) as s:
            s.sendall(b"GET " + path + b" HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            if s.recv(64).startswith(b"HTTP/1.1 200"):
                return
        time.sleep(0.05)
    raise RuntimeError(f"port {port} did not answer {path!r}")


def _gateway_config(backend_port: int, streams: int, flush_ms: float, path: Path) -> None:
    path.write_text(
        json.dumps(
            {  # JSON is YAML
                "backends": [
                    {
                        "name": "b0",
                        "url": f"http://127.0.0.1:{backend_port}",
                        "models": [_MODEL],
                        "gpus": 1,
                    }
                ],
                "gate": {"max_concurrency_per_gpu": streams * 2, "queue": {"max_waiting": streams}},
                "sla": {"ttft_ms": None},
                "kv": {"pressure_threshold": None},
                "streaming": {"sse_flush_interval": flush_ms, "first_token_timeout_ms": 30000},
                "metrics": {"scrape_interval_ms": 500},
            }
        )
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with `--backend`, only the backend server)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=256, help="concurrent streams")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per phase and arm")
    p.add_argument("--tokens", type=int, default=128, help="tokens per TTFT-phase request")
    p.add_argument("--ttft-ms", type=float, default=20.0, help="backend time to first token")
    p.add_argument("--itl-ms", type=float, default=32.0, help="backend inter-token latency")
    p.add_argument("--burst-tokens", type=int, default=256, help="tokens per throughput request")
    p.add_argument("--flush-ms", type=float, default=0.0, help="gateway sse_flush_interval")
    p.add_argument(
        "--pin",
        action="store_true",
        help="pin the gateway to one CPU, backend and clients to the others",
    )
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--backend", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    _use_uvloop()
    if args.backend:
        asyncio.run(_serve_backend(args.backend))
        return 0
    return _run(args)


def _use_uvloop() -> None:
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def _run(args: argparse.Namespace) -> int:
    backend_port, gateway_port = _free_port(), _free_port()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        config = Path(tmp) / "gateway.yaml"
        _gateway_config(backend_port, args.streams, args.flush_ms, config)
        pins = _pins(args.pin)
        for cmd, cpus in (
            ([sys.executable, __file__, "--backend", str(backend_port)], pins[0]),
            (
                [
                    sys.executable,
                    "-m",
                    "llmflow.cli",
                    "serve",
                    "--config",
                    str(config),
                    "--port",
                    str(gateway_port),
                    "--log-level",
                    "warning",
                ],
                pins[1],
            ),
        ):
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            stack.callback(_stop, proc)
            if cpus:
                os.sched_setaffinity(proc.pid, cpus)
        if pins[0]:
            os.sched_setaffinity(0, pins[0])
        _wait_port(backend_port, b"/metrics")
        _wait_port(gateway_port, b"/readyz")
        results = asyncio.run(_phases(args, backend_port, gateway_port))
    _report(args, results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def _pins(pin: bool) -> tuple[set[int], set[int]]:
    """With `--pin`: the gateway gets the last CPU to itself; backend and clients share the rest."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not pin or len(cpus) < 2:
        return set(), set()
    return set(cpus[:-1]), {cpus[-1]}


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


async def _phases(args: argparse.Namespace, backend: int, gateway: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "streams": args.streams,
        "duration_s": args.duration,
        "flush_ms": args.flush_ms,
        "cpus": os.cpu_count(),
        "pinned": args.pin,
    }
    for phase, tokens, ttft, itl in (
        ("ttft", args.tokens, args.ttft_ms, args.itl_ms),
        ("throughput", args.burst_tokens, 0.0, 0.0),
    ):
        for arm, port in (("direct", backend), ("gateway", gateway)):
            await _load(port, args.streams, 1.0, _request(port, tokens, ttft / 1e3, itl / 1e3))
            out[f"{phase}_{arm}"] = await _load(
                port, args.streams, args.duration, _request(port, tokens, ttft / 1e3, itl / 1e3)
            )
    d, g = out["ttft_direct"]["ttft_ms"], out["ttft_gateway"]["ttft_ms"]
    out["added_ttft_ms"] = {k: round(g[k] - d[k], 3) for k in ("p50", "p99")}
    return out


def _report(args: argparse.Namespace, r: dict[str, Any]) -> None:
    rows = [
        (
            "TTFT p50 (ms)",
            r["ttft_direct"]["ttft_ms"]["p50"],
            r["ttft_gateway"]["ttft_ms"]["p50"],
            r["added_ttft_ms"]["p50"],
        ),
        (
            "TTFT p99 (ms)",
            r["ttft_direct"]["ttft_ms"]["p99"],
            r["ttft_gateway"]["ttft_ms"]["p99"],
            r["added_ttft_ms"]["p99"],
        ),
        (
            "chunks/s, paced phase",
            r["ttft_direct"]["chunks_per_s"],
            r["ttft_gateway"]["chunks_per_s"],
            "",
        ),
        (
            "chunks/s, back-to-back",
            r["throughput_direct"]["chunks_per_s"],
            r["throughput_gateway"]["chunks_per_s"],
            "",
        ),
    ]
    print(
        f"{args.streams} concurrent streams, {args.duration:g} s per arm, flush "
        f"{args.flush_ms:g} ms, {os.cpu_count()} CPUs{', pinned' if args.pin else ''}"
    )
    print("| metric | direct | gateway | added |\n|---|---:|---:|---:|")
    for name, direct, gateway, added in rows:
        print(f"| {name} | {direct} | {gateway} | {added} |")


if __name__ == "__main__":
    raise SystemExit(main())
