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

A VIP client in a process of its own (`tests/reliability/vip_probe.py`, on the client's CPU)
sends one small chat request after another: for a second before the flood, then through each burst.
llmflow serves it (8 tokens from the simulated vLLM); nginx answers it the 429 it answers
everyone, which is the floor for any request in that flood on this machine. Its latencies are
reported per phase (the issue's goal: p99 <= 50 ms during the all-at-once flood). Beside it,
while llmflow runs, a second VIP client sends the same request straight to the simulated vLLM
(which shares the client's CPU with the flood): what the backend itself takes then, so the
difference is what the gateway adds.

With `--baseline DIR` (another checkout's `python/`, its extension built), that build runs
too, as `llmflow-base`, interleaved with this one in each repeat: a change's A/B.

Usage: `python -m benchmarks.flood_floor [--repeats 2] [--baseline DIR] [--json OUT]` (needs
`nginx` on PATH: `apt-get install nginx-light`; the fd limit raised to 12,000 or more).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
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
from tests.reliability.vip_probe import Probe

CLIENT_CPU, SERVER_CPU = {0}, {1}
# The VIP probe's phases (its labels); the flood test's VIP key.
BEFORE, ALL_AT_ONCE, PACED = 1, 2, 3
VIP_KEY = "k-vip"

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


async def _flood(port: int, probes: dict[str, Probe]) -> dict[str, Any]:
    """The test's bursts on fresh connections: 429 latency percentiles, in ms, and each
    probe's latencies by phase."""
    conns = await open_conns(port, CONNECTIONS)
    request = chat_request("k-crowd", MODEL)
    out: dict[str, Any] = {}
    for probe in probes.values():
        probe.phase(BEFORE)
    await asyncio.sleep(1.0)
    try:
        for name, label, per_s, part in (
            ("all_at_once", ALL_AT_ONCE, None, conns[:BURST]),
            ("paced", PACED, PACED_PER_S, conns[BURST : 2 * BURST]),
        ):
            for probe in probes.values():
                probe.phase(label)
            answers = await burst(part, request, per_s)
            for probe in probes.values():
                probe.phase(0)
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
        seen = {name: probe.stop() for name, probe in probes.items()}
    for (probe_name, vip), (phase, label) in itertools.product(
        seen.items(), (("before", BEFORE), ("all_at_once", ALL_AT_ONCE), ("paced", PACED))
    ):
        samples = vip.get(label, [])
        seconds = [s for _, s in samples]
        out[f"{probe_name}_{phase}"] = {
            "requests": len(samples),
            "statuses": sorted({status for status, _ in samples}),
            "p50_ms": round(percentile(seconds, 0.50) * 1e3, 1) if seconds else None,
            "p99_ms": round(percentile(seconds, 0.99) * 1e3, 1) if seconds else None,
            "max_ms": round(max(seconds) * 1e3, 1) if seconds else None,
            "all_ms": [round(s * 1e3, 1) for s in seconds],
        }
    return out


def _probe(port: int, *, stream: bool) -> Probe:
    return Probe(port, chat_request(VIP_KEY, MODEL, stream=stream), CLIENT_CPU)


def _vip_table(runs: list[dict[str, Any]]) -> None:
    print("\n| server | VIP client | run | before: n, p50 / p99 (ms) | in the all-at-once flood: "
          "n, p50 / p99 / max (ms) | in the paced flood: n, p50 / p99 / max (ms) |")
    print("|---|---|---|---|---|---|")
    for run, probe in itertools.product(runs, ("vip", "vip_direct")):
        if f"{probe}_before" not in run:
            continue
        b, a, p = run[f"{probe}_before"], run[f"{probe}_all_at_once"], run[f"{probe}_paced"]
        print(
            f"| {run['server']} | {_PROBES[probe]} | {run['repeat'] + 1} | {b['requests']}, "
            f"{b['p50_ms']} / {b['p99_ms']} | {a['requests']}, {a['p50_ms']} / {a['p99_ms']} / "
            f"{a['max_ms']} | {p['requests']}, {p['p50_ms']} / {p['p99_ms']} / {p['max_ms']} |"
        )
    for server, probe in itertools.product(_SERVERS, ("vip", "vip_direct")):
        for phase in ("all_at_once", "paced"):
            during = sorted(
                s
                for run in runs
                if run["server"] == server and f"{probe}_{phase}" in run
                for s in run[f"{probe}_{phase}"]["all_ms"]
            )
            if during:
                print(f"{server}, {_PROBES[probe]}, {phase} flood, every run: {len(during)} "
                      f"requests, p50 {percentile(during, 0.5)} ms, p99 "
                      f"{percentile(during, 0.99)} ms, max {during[-1]} ms")


_PROBES = {"vip": "through the server", "vip_direct": "straight to the simulated vLLM"}
_SERVERS = ("llmflow", "llmflow-base", "nginx")


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


def _llmflow_flood(
    workdir: Path, hard: int, pythonpath: Path | None, args: argparse.Namespace
) -> tuple[dict[str, Any], bytes, str]:
    """One flood through `llmflow serve` (of this checkout, or of `pythonpath`): its figures,
    and the refusal it answers (nginx answers the same)."""
    with SimServeProcess(workdir, "--model-name", MODEL, "--speed", "4") as backend:
        with _pinned(SERVER_CPU):
            gw = GatewayProcess(
                _config(backend.url), workdir, max_open_files=hard, pythonpath=pythonpath
            )
            gw.start()
        try:
            body, retry_after = asyncio.run(_refused_reply(gw.port))
            time.sleep(2.0)  # the filling requests finish
            probes = {"vip": _probe(gw.port, stream=args.vip_stream),
                      "vip_direct": _probe(backend.port, stream=args.vip_stream)}
            return asyncio.run(_flood(gw.port, probes)), body, retry_after
        finally:
            gw.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs of each")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--baseline", type=Path,
                        help="another checkout's python/ (its extension built), run beside")
    parser.add_argument("--vip-stream", action="store_true",
                        help="the VIP asks for a streamed reply (timed to its last byte)")
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
            builds: list[tuple[str, Path | None]] = [("llmflow", None)]
            if args.baseline is not None:
                builds.append(("llmflow-base", args.baseline))
            for server, pythonpath in builds:
                figures, body, retry_after = _llmflow_flood(workdir, hard, pythonpath, args)
                runs.append({"server": server, "repeat": repeat, **figures})
            with _nginx(workdir, body, retry_after) as port:
                figures = asyncio.run(_flood(port, {"vip": _probe(port, stream=False)}))
                runs.append({"server": "nginx", "repeat": repeat, **figures})
            for run in runs[-len(builds) - 1 :]:
                print(json.dumps({k: v for k, v in run.items() if not k.startswith("vip")}),
                      flush=True)
    print("\n| server | run | all at once p50 / p99 (ms) | paced 1,000/s p50 / p99 (ms) |")
    print("|---|---|---|---|")
    for run in runs:
        a, p = run["all_at_once"], run["paced"]
        print(
            f"| {run['server']} | {run['repeat'] + 1} | {a['p50_ms']} / {a['p99_ms']} "
            f"| {p['p50_ms']} / {p['p99_ms']} |"
        )
    _vip_table(runs)
    if args.json:
        for run in runs:  # every sample where there are few (nginx answers 100,000s)
            for figures in run.values():
                if isinstance(figures, dict) and figures.get("requests", 0) > 2000:
                    del figures["all_ms"]
        result = {"date": time.strftime("%Y-%m-%d"), "runs": runs}
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
