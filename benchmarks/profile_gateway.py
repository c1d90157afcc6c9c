"""Profile the gateway's per-chunk hot path with py-spy, and say where its CPU goes.

Reuses `gateway_bench.py`: its vLLM-format fake backend (a subprocess), its gateway config
(`sse_flush_interval` 0: every chunk forwarded on its own) and its raw-socket keep-alive
clients. Only the gateway's HTTP API and CLI are used, so the script keeps working whatever the
gateway does inside. Steps, for each phase:

1. warm up, then one unprofiled window: the gateway's CPU seconds (from `/proc/PID/stat`) per
   chunk the clients counted;
2. `py-spy record` on the gateway for the same window, three times (flamegraph SVG, speedscope
   JSON, raw collapsed stacks), each under the same load;
3. the raw and speedscope stacks sorted into buckets (socket read and SSE de-framing, usage cut,
   `Runtime.tokens`, window hand-off, uvicorn send/transport write, per-request work, event
   loop) by the innermost frame that names one, printed as a markdown table.

Phases: `paced` (first token after 20 ms, then 128 tokens 32 ms apart: each chunk arrives and
leaves alone, the costliest case per chunk) and `burst` (256 tokens back to back).

Usage: `python -m benchmarks.profile_gateway [--streams 64] [--duration 15] [--phases paced,burst]
[--native] [--out-dir docs/img] [--py-spy PATH] [--json OUT]`. py-spy needs ptrace rights
(root, or `kernel.yama.ptrace_scope=0`); install it anywhere (`pip install py-spy`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.processes import free_port

# ---- harness: the fake backend, clients and config of gateway_bench.py as of commit 7a4bf44,
# copied so that this script does not move with that benchmark's rewrite -----------------------

_REPO = Path(__file__).resolve().parents[1]  # where the backend (`-m _SELF --backend`) runs
_SELF = "benchmarks.profile_gateway"
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


def _wait_port(port: int, path: bytes, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1) as s:
            s.sendall(b"GET " + path + b" HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n")
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


def _use_uvloop() -> None:
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


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


# ---- profiling ------------------------------------------------------------------------------


_PHASES = {  # tokens, ttft_ms, itl_ms
    "paced": (128, 20.0, 32.0),
    "burst": (256, 0.0, 0.0),
}

# Buckets, by the innermost frame of our own code (or uvicorn's, asyncio's) that a rule matches,
# so a native leaf (a `write` syscall, uvloop's C) goes to whoever called it; a stack with no
# such frame falls back to the native rules, then to the event loop (its C code, task switches,
# epoll). Per-request frames: routing, the handler, the session's set-up and close, opening the
# upstream request, the scraper, parsing the client's request.
_PER_REQUEST = "per request (handler, session set-up/close, upstream open, scraper)"
_ASGI = "ASGI stack: middleware/routing frames (routing; resumed on every send)"
_RULES: list[tuple[str, str]] = [
    ("Python's cyclic GC (wherever it triggers)", r"^gc_collect|^collect_with_callback"),
    (
        _PER_REQUEST,
        r"Upstream\.(open|get) |ConnectionPool\.|Scraper\.|StreamSession\.(start|arrive|close|"
        r"__init__|_close_upstream|_done|on_\w+) |UpstreamStream\.aclose|HttpResponse\.release|"
        r"^_finish \(llmflow/gateway/upstream|Host\.(arrive|started|done|new_id) |"
        r"gateway/(serving|app|protocol|auth|tokens|errors)\.py|gateway/routes/|"
        r"HttpToolsProtocol\.|RequestResponseCycle\.(receive|__init__) |"
        r"_until_disconnect|GatewayMetrics\.(request_ended|first_token) |"
        r"SessionStream\.(__init__|__call__) |create_task_group|CancelScope|TaskGroup",
    ),
    (
        "runtime.tokens (host + Rust core)",
        r"Host\.tokens |Runtime\.tokens|^now_us |^_core::|llmflow/_core\.cpython",
    ),
    (
        "usage cut / JSON (ChunkParser)",
        r"ChunkParser\.|gateway/streaming\.py|^(loads|dumps) \(json/",
    ),
    ("window hand-off (ChunkWindow put/take, wake-ups)", r"ChunkWindow\.|gateway/backpressure\.py"),
    ("metrics (inter-chunk histogram)", r"gateway/metrics\.py|prometheus_client"),
    (
        "uvicorn send / transport write",
        r"RequestResponseCycle\.send |SessionStream\._write |gateway/sse\.py|"
        r"_exception_handler\.py:39\)|middleware/errors\.py:161\)",
    ),
    (
        "socket read + SSE de-framing (http1, upstream)",
        r"HttpResponse\.iter_body |_dechunk |_chunk_size |UpstreamStream\.events |_data_of |"
        r"StreamReader(Protocol)?\.|asyncio/streams\.py",
    ),
    ("session reader (_pump's own lines)", r"StreamSession\._(pump|read) "),
    (
        _ASGI,
        r"RequestResponseCycle\.run_asgi|uvicorn/middleware|\((starlette|fastapi)/|"
        r"gateway/middleware\.py",
    ),
]
_NATIVE: list[tuple[str, str]] = [  # only when no frame above matched
    ("event loop: epoll_wait (polling; py-spy --native counts it)", r"epoll_p?wait|uv__io_poll"),
    ("uvicorn send / transport write", r"UVStream.*write|uv__write|^(write|writev|sendmsg) \(libc"),
    (
        "socket read + SSE de-framing (http1, upstream)",
        r"UVStream.*read|uv__read|^(read|recv) \(libc",
    ),
]
_LOOP = "event loop: task switches, callbacks, other"


def _bucket(frames: list[str]) -> str:
    """The bucket of one sample (see `_RULES`)."""
    for rules in (_COMPILED, _COMPILED_NATIVE):
        for frame in reversed(frames):
            for name, pattern in rules:
                if pattern.search(frame):
                    return name
    return _LOOP


_COMPILED = [(name, re.compile(p)) for name, p in _RULES]
_COMPILED_NATIVE = [(name, re.compile(p)) for name, p in _NATIVE]


def _short(path: str) -> str:
    """A speedscope frame's file as py-spy's raw format writes it."""
    if not path.endswith(".py"):
        return path.rsplit("/", 1)[-1]  # a native library or C source
    for marker in ("/site-packages/", "/python/llmflow/"):
        if marker in path:
            rest = path.split(marker, 1)[1]
            return rest if marker == "/site-packages/" else "llmflow/" + rest
    return re.sub(r"^.*/lib/python3\.\d+/", "", path)


def _stacks(path: Path) -> list[tuple[list[str], float]]:
    """(frames outermost first, weight) from py-spy's raw or speedscope output."""
    out: list[tuple[list[str], float]] = []
    if path.suffix == ".json":
        doc = json.loads(path.read_text())
        names = [
            f"{f['name']} ({_short(f.get('file', '?'))}:{f.get('line', 0)})"
            if f.get("line")
            else f"{f['name']} ({_short(f.get('file', '?'))})"
            for f in doc["shared"]["frames"]
        ]
        for prof in doc["profiles"]:  # weights in seconds: one sample = the smallest one
            tick = min((w for w in prof["weights"] if w > 0), default=1.0)
            out += [
                ([names[i] for i in sample], weight / tick)
                for sample, weight in zip(prof["samples"], prof["weights"], strict=True)
            ]
        return out
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if n.isdigit():
            frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
            out.append((frames, float(n)))
    return out


def summarise(paths: list[Path]) -> dict[str, Any]:
    """Bucket the samples of py-spy raw/speedscope files (percent of all samples)."""
    counts: dict[str, float] = {}
    leaves: dict[str, float] = {}
    total = 0.0  # samples (weights are sample counts, so floats only for speedscope's ticks)
    for path in paths:
        for frames, weight in _stacks(path):
            total += weight
            bucket = _bucket(frames)
            counts[bucket] = counts.get(bucket, 0.0) + weight
            if frames:
                leaves[frames[-1]] = leaves.get(frames[-1], 0.0) + weight
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    share = {k: round(100 * v / total, 1) for k, v in ranked} if total else {}
    hot = sorted(leaves.items(), key=lambda kv: -kv[1])[:15]
    top = [(f, round(100 * v / total, 1)) for f, v in hot] if total else []
    return {"samples": round(total), "buckets_pct": share, "top_leaves_pct": top}


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _window(
    port: int, gateway_pid: int, streams: int, duration: float, payload: bytes
) -> dict[str, Any]:
    cpu0, t0 = _cpu_s(gateway_pid), time.perf_counter()
    result = await _load(port, streams, duration, payload)
    cpu = _cpu_s(gateway_pid) - cpu0
    result["gateway_cpu_s"] = round(cpu, 2)
    result["gateway_cpu_share"] = round(cpu / (time.perf_counter() - t0), 2)
    result["gateway_us_per_chunk"] = round(cpu / max(result["chunks"], 1) * 1e6, 1)
    return result


async def _profile_phase(
    args: argparse.Namespace, phase: str, port: int, gateway_pid: int, out_dir: Path
) -> dict[str, Any]:
    tokens, ttft_ms, itl_ms = _PHASES[phase]
    payload = _request(port, tokens, ttft_ms / 1e3, itl_ms / 1e3)
    await _load(port, args.streams, 2.0, payload)  # warm up
    out: dict[str, Any] = {
        "unprofiled": await _window(port, gateway_pid, args.streams, args.duration, payload)
    }
    suffix = "" if phase == "paced" else f"-{phase}"
    files = {
        "flamegraph": out_dir / f"{args.name}{suffix}.svg",
        "speedscope": out_dir / f"{args.name}{suffix}.speedscope.json",
        "raw": Path(args.tmp) / f"{phase}.collapsed",
    }
    files = {k: v for k, v in files.items() if k in args.formats or k == "raw"}
    for fmt, path in files.items():
        cmd = [
            args.py_spy,
            "record",
            "--pid",
            str(gateway_pid),
            "--rate",
            str(args.rate),
            "--duration",
            str(int(args.duration)),
            "--format",
            fmt,
            "-o",
            str(path),
        ]
        if args.native:
            cmd.append("--native")
        if args.nonblocking:
            cmd.append("--nonblocking")
        spy = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )
        load = await _window(port, gateway_pid, args.streams, args.duration, payload)
        _, err = await spy.communicate()
        if spy.returncode:
            raise RuntimeError(f"py-spy failed: {err.decode()[-2000:]}")
        out[f"profiled_{fmt}"] = load
    if args.keep_raw:
        shutil.copy(files["raw"], out_dir / f"{args.name}{suffix}.collapsed.txt")
    out["profile"] = summarise([v for k, v in files.items() if k in ("raw", "speedscope")])
    out["files"] = {k: str(v) for k, v in files.items() if k != "raw"}
    return out


async def _run_phases(args: argparse.Namespace, port: int, pid: int) -> dict[str, Any]:
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return {p: await _profile_phase(args, p, port, pid, out_dir) for p in args.phases}


def _report(args: argparse.Namespace, results: dict[str, Any]) -> None:
    phases = list(results["phases"])
    names: list[str] = []
    for p in phases:
        for name in results["phases"][p]["profile"]["buckets_pct"]:
            if name not in names:
                names.append(name)
    print(
        f"\n{args.streams} streams, {args.duration:g} s windows, py-spy {results['py_spy']}, "
        f"rate {args.rate} Hz{', --native' if args.native else ''}"
        f"{', --nonblocking' if args.nonblocking else ''}{', pinned' if args.pin else ''}"
    )
    print("| where the gateway's CPU goes | " + " | ".join(f"{p} (%)" for p in phases) + " |")
    print("|---|" + "---:|" * len(phases))
    for name in names:
        cells = [str(results["phases"][p]["profile"]["buckets_pct"].get(name, 0.0)) for p in phases]
        print(f"| {name} | " + " | ".join(cells) + " |")
    for p in phases:
        r = results["phases"][p]
        u = r["unprofiled"]
        print(
            f"\n{p}: unprofiled {u['chunks_per_s']} chunks/s, gateway {u['gateway_cpu_share']} "
            f"of a core, {u['gateway_us_per_chunk']} us CPU per chunk; "
            f"{r['profile']['samples']} samples"
        )
        for k, v in r.items():
            if k.startswith("profiled_"):
                print(
                    f"  while {k[9:]} recorded: {v['chunks_per_s']} chunks/s, "
                    f"{v['gateway_us_per_chunk']} us CPU per chunk"
                )
        for frame, pct in r["profile"]["top_leaves_pct"][:10]:
            print(f"    {pct:5.1f}%  {frame}")


def _print_summaries(profiles: dict[str, dict[str, Any]]) -> None:
    names: list[str] = []
    for profile in profiles.values():
        names += [n for n in profile["buckets_pct"] if n not in names]
    print("| bucket | " + " | ".join(f"{Path(k).name} (%)" for k in profiles) + " |")
    print("|---|" + "---:|" * len(profiles))
    for name in names:
        cells = [str(p["buckets_pct"].get(name, 0.0)) for p in profiles.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("| samples | " + " | ".join(str(p["samples"]) for p in profiles.values()) + " |")


def main(argv: list[str] | None = None) -> int:
    """Start backend and gateway, profile each phase, print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=64, help="concurrent streams")
    p.add_argument("--duration", type=float, default=15.0, help="seconds per window")
    p.add_argument("--phases", default="paced,burst", help="comma-separated: paced, burst")
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--native", action="store_true", help="py-spy --native (C/Rust frames)")
    p.add_argument(
        "--nonblocking", action="store_true", help="py-spy --nonblocking (not with --native)"
    )
    p.add_argument("--formats", default="flamegraph,speedscope", help="besides raw")
    p.add_argument("--name", default="profile-gateway-python", help="output file stem")
    p.add_argument("--pin", action="store_true", help="gateway on its own CPU (see gateway_bench)")
    p.add_argument("--out-dir", default="docs/img", help="where the SVG/speedscope files go")
    p.add_argument("--keep-raw", action="store_true", help="also keep the collapsed stacks there")
    p.add_argument(
        "--py-spy",
        default=shutil.which("py-spy") or str(Path.home() / ".cache/llmflow/tools/venv/bin/py-spy"),
    )
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument(
        "--summarise",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="only bucket saved py-spy raw/speedscope files (one column each) and print the table",
    )
    p.add_argument("--backend", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.summarise:
        _print_summaries({str(path): summarise([path]) for path in args.summarise})
        return 0
    if args.backend:  # the fake backend's own process
        _use_uvloop()
        asyncio.run(_serve_backend(args.backend))
        return 0
    args.phases = [x for x in args.phases.split(",") if x]
    args.formats = [x for x in args.formats.split(",") if x]
    _use_uvloop()
    version = subprocess.run(
        [args.py_spy, "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    backend_port, gateway_port = free_port(), free_port()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        args.tmp = tmp
        config = Path(tmp) / "gateway.yaml"
        _gateway_config(backend_port, args.streams, 0.0, config)
        pins = _pins(args.pin)
        procs = []
        for cmd, cpus in (
            ([sys.executable, "-m", _SELF, "--backend", str(backend_port)], pins[0]),
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
            proc = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=_REPO
            )
            stack.callback(_stop, proc)
            procs.append(proc)
            if cpus:
                os.sched_setaffinity(proc.pid, cpus)
        if pins[0]:
            os.sched_setaffinity(0, pins[0])
        _wait_port(backend_port, b"/metrics")
        _wait_port(gateway_port, b"/readyz")
        started = time.time()
        phases = asyncio.run(_run_phases(args, gateway_port, procs[1].pid))
    results = {
        "date": time.strftime("%Y-%m-%d", time.localtime(started)),
        "py_spy": version,
        "streams": args.streams,
        "duration_s": args.duration,
        "native": args.native,
        "nonblocking": args.nonblocking,
        "rate_hz": args.rate,
        "pinned": args.pin,
        "load_average": os.getloadavg(),
        "phases": phases,
    }
    _report(args, results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
