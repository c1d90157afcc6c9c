"""The flood's 429 latency against a floor: nginx answering the same 429 from memory.

`make reliability` times a 5,000-request burst of refused requests from one Python client
process. Part of each figure is the client's own: one asyncio loop writes every request and
reads every answer, on the same two cores as the server. This script runs the test's exact
burst (the shared client in `tests/reliability/flood.py`) against two servers in one run,
interleaved, each pinned to CPU 1 with the client (and the simulated vLLM behind llmflow) on
CPU 0:

- `llmflow serve` with the flood test's config (4 slots, 32 waiting places): the burst's
  first 36 requests get in, the rest are refused by the runtime;
- nginx (Debian's, one worker process, access log off) answering every request with the
  429 that llmflow sent, byte for byte in its body and `Retry-After`: no server answers an
  HTTP request in less, so its figures are what this client on this machine can measure.

For each: 10,000 connections are opened, then 5,000 requests all at once, then 5,000 paced at
1,000/s, and the 429s' latency (write to last byte read) is reported as p50/p99.

Usage: `python -m benchmarks.flood_floor [--repeats 2] [--json OUT]` (needs `nginx` on PATH:
`apt-get install nginx-light`; the fd limit raised to 12,000 or more).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator

from tests.processes import GatewayProcess, SimServeProcess, free_port
from tests.reliability.flood import burst, chat_request, open_conns, percentile
from tests.reliability.test_flood import BURST, CONNECTIONS, MODEL, PACED_PER_S, _config

CLIENT_CPU, SERVER_CPU = {0}, {1}

_NGINX_CONF = """
daemon off;
master_process off;
worker_processes 1;
error_log {dir}/error.log warn;
pid {dir}/nginx.pid;
worker_rlimit_nofile 30000;
events {{ worker_connections 20000; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    keepalive_requests 1000000;
    keepalive_timeout 120s;
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            default_type application/json;
            add_header Retry-After {retry_after} always;
            return 429 '{body}';
        }}
    }}
}}
"""


async def _refused_reply(port: int) -> tuple[bytes, str]:
    """One refused request's body and Retry-After, read from a full llmflow."""
    conns = await open_conns(port, 64)
    request = chat_request("k-crowd", MODEL)
    try:
        for conn in conns:
            conn.writer.write(request)
        for conn in conns:
            head = await conn.reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            fields = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
            body = await conn.reader.readexactly(int(fields["content-length"]))
            if lines[0].split(" ")[1] == "429":
                return body, fields["retry-after"]
    finally:
        for conn in conns:
            conn.writer.close()
    raise RuntimeError("no request was refused: the gateway's queue did not fill")


async def _flood(port: int) -> dict[str, Any]:
    """The test's bursts on fresh connections: 429 latency percentiles, in ms."""
    conns = await open_conns(port, CONNECTIONS)
    request = chat_request("k-crowd", MODEL)
    out: dict[str, Any] = {}
    try:
        for name, per_s, part in (
            ("all_at_once", None, conns[:BURST]),
            ("paced", PACED_PER_S, conns[BURST : 2 * BURST]),
        ):
            answers = await burst(part, request, per_s)
            refused = [t for s, t in answers if s == 429]
            out[name] = {
                "refused": len(refused),
                "p50_ms": round(percentile(refused, 0.50) * 1e3, 1),
                "p99_ms": round(percentile(refused, 0.99) * 1e3, 1),
            }
            await asyncio.sleep(1.0)  # let the servers' queues (the running 200s) settle
    finally:
        for conn in conns:
            conn.writer.close()
    return out


@contextlib.contextmanager
def _pinned(cpus: set[int]) -> Iterator[None]:
    """Children started inside inherit `cpus`; this process goes back to the client's CPU."""
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, CLIENT_CPU)


@contextlib.contextmanager
def _nginx(workdir: Path, body: bytes, retry_after: str) -> Iterator[int]:
    port = free_port()
    conf = workdir / "nginx.conf"
    escaped = body.decode().replace("\\", "\\\\").replace("'", "\\'")
    conf.write_text(
        _NGINX_CONF.format(dir=workdir, port=port, body=escaped, retry_after=retry_after)
    )
    with _pinned(SERVER_CPU):
        proc = subprocess.Popen(["nginx", "-c", str(conf)], stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs of each")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    if shutil.which("nginx") is None:
        sys.exit("nginx is not on PATH: apt-get install nginx-light")
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < CONNECTIONS + 2000:
        sys.exit(f"the fd hard limit {hard} is below {CONNECTIONS + 2000}: raise it (ulimit -Hn)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    os.sched_setaffinity(0, CLIENT_CPU)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for repeat in range(args.repeats):
            with SimServeProcess(workdir, "--model-name", MODEL, "--speed", "4") as backend:
                with _pinned(SERVER_CPU):
                    gw = GatewayProcess(_config(backend.url), workdir, max_open_files=hard)
                    gw.start()
                try:
                    body, retry_after = asyncio.run(_refused_reply(gw.port))
                    time.sleep(2.0)  # the filling requests finish
                    figures = asyncio.run(_flood(gw.port))
                    runs.append({"server": "llmflow", "repeat": repeat, **figures})
                finally:
                    gw.stop()
            with _nginx(workdir, body, retry_after) as port:
                runs.append({"server": "nginx", "repeat": repeat, **asyncio.run(_flood(port))})
            print(json.dumps(runs[-2]), json.dumps(runs[-1]), sep="\n", flush=True)
    print("\n| server | run | all at once p50 / p99 (ms) | paced 1,000/s p50 / p99 (ms) |")
    print("|---|---|---|---|")
    for run in runs:
        a, p = run["all_at_once"], run["paced"]
        print(
            f"| {run['server']} | {run['repeat'] + 1} | {a['p50_ms']} / {a['p99_ms']} "
            f"| {p['p50_ms']} / {p['p99_ms']} |"
        )
    if args.json:
        result = {"date": time.strftime("%Y-%m-%d"), "runs": runs}
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
