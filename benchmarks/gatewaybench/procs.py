"""The processes under test: start them pinned, read their CPU time and memory from /proc.

Pinning is set in the child before `exec` (so every thread the server later starts inherits it,
and the router's Tokio runtime sizes itself to the CPUs it may use); the child also raises
RLIMIT_NOFILE to its hard limit, since 5,000 held streams need ~10,000 descriptors in a gateway.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tests.processes import free_port

from benchmarks.gatewaybench.backend import MODEL

if TYPE_CHECKING:
    from collections.abc import Callable

ROUTER_VERSION = "0.1.17"
ROUTER_VENV = Path.home() / ".cache" / "llmflow" / f"vllm-router-{ROUTER_VERSION}"
SLA_MS = 3_600_000  # llmflow's TTFT SLA in the bench: see `llmflow_config`
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def raise_nofile() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit; returns the new soft limit."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def _child_setup(cpus: set[int] | None) -> Callable[[], None]:
    def setup() -> None:
        raise_nofile()
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


@dataclass
class Proc:
    """One started server: its name, listening port and process."""

    name: str
    port: int
    popen: subprocess.Popen[bytes]
    cpus: set[int] | None
    log: Path

    @property
    def pid(self) -> int:
        """The server's process id."""
        return self.popen.pid

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s (llmflow drains its live requests first)."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def spawn(
    name: str,
    cmd: list[str],
    port: int,
    cpus: set[int] | None,
    logdir: Path,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> Proc:
    """Start `cmd` with its output in `logdir/name.log`, pinned to `cpus` (None: unpinned)."""
    log = logdir / f"{name}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=_child_setup(cpus),
            cwd=cwd,
            env=env,
        )
    return Proc(name, port, popen, cpus, log)


def wait_http(proc: Proc, path: str, timeout: float = 60.0) -> None:
    """Wait until `proc` answers `GET path` with 200; raise with its log tail if it does not."""
    deadline = time.monotonic() + timeout
    request = f"GET {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n".encode()
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            break
        try:
            with socket.create_connection(("127.0.0.1", proc.port), 1) as s:
                s.sendall(request)
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.1)
    tail = proc.log.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"{proc.name} did not answer {path} on port {proc.port}:\n{tail}")


def _tree(pid: int) -> list[int]:
    """`pid` and all its descendants (a server's CPU and memory may live in a child)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


def cpu_seconds(pid: int, tree: bool = True) -> float:
    """utime + stime of the process (and, with `tree`, its descendants), every thread, in s."""
    total = 0
    for p in _tree(pid) if tree else [pid]:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (stat fields 14 and 15)
    return total / _CLK_TCK


def cpu_busy() -> dict[int, float]:
    """Seconds each CPU has been busy (user, nice, system, irq, softirq, steal) since boot.

    Against the pinned processes' own CPU time this shows what the machine's other work took
    from each CPU during a run: the shared machine's noise, in figures.
    """
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                name, *v = line.split()
                out[int(name[3:])] = sum(int(v[i]) for i in (0, 1, 2, 5, 6, 7)) / _CLK_TCK
    return out


def rss_bytes(pid: int) -> int:
    """VmRSS of the process and its descendants, in bytes."""
    total = 0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def threads(pid: int) -> int:
    """Threads of the process (the router's Tokio pool, llmflow's relay workers)."""
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


# ---- the three arms ------------------------------------------------------------------------


def start_backend(root: Path, cpus: set[int] | None, logdir: Path) -> Proc:
    """The fake vLLM (this benchmark's `--backend` mode, run from the checkout `root`), pinned
    with the clients."""
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.gateway_bench", "--backend", str(port)]
    proc = spawn("backend", cmd, port, cpus, logdir, cwd=root)
    wait_http(proc, "/health")
    return proc


def llmflow_config(backend_port: int, cap: int, path: Path) -> dict[str, object]:
    """Write llmflow's config for the bench and return it.

    Policy defaults throughout (admission, fair queue, tiers, KV ledger and pressure,
    preemption breaker, deadlines), except:
    - a slot cap and a queue big enough for every stream the bench opens (5,000 held);
    - `sse_flush_interval: 0`: every chunk forwarded on its own, as the router does;
    - the TTFT SLA at one hour instead of 1.5 s: still evaluated on every admission, but the
      fake vLLM's fixed 20 ms first token on a 16-token prompt teaches the core a prefill rate
      of ~800 tokens/s, so at 1.5 s it refused about a quarter of the memory phase's 1,000
      simultaneous arrivals (as it should in front of so slow a backend).
    The KV ledger learns its block count from the fake vLLM's `vllm:cache_config_info`.
    """
    config: dict[str, object] = {
        "backends": [
            {"name": "b0", "url": f"http://127.0.0.1:{backend_port}", "models": [MODEL], "gpus": 1}
        ],
        "gate": {"max_concurrency_per_gpu": cap, "queue": {"max_waiting": cap}},
        "streaming": {"sse_flush_interval": 0},
        "sla": {"ttft_ms": SLA_MS},
    }
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    return config


def config_problem(path: Path) -> str | None:
    """What `llmflow config check` says is wrong with the config at `path` (None: valid)."""
    out = subprocess.run(
        [sys.executable, "-m", "llmflow.cli", "config", "check", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    return None if out.returncode == 0 else (out.stderr or out.stdout).strip()


def llmflow_workers_flag() -> bool:
    """Whether this checkout's `llmflow serve` takes `--workers N`."""
    out = subprocess.run(
        [sys.executable, "-m", "llmflow.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    return "--workers" in out.stdout


def start_llmflow(
    config: Path,
    cpus: set[int] | None,
    logdir: Path,
    workers: int | None = None,
    name: str = "llmflow",
    pythonpath: Path | None = None,
) -> Proc:
    """`llmflow serve` on a free port (optionally with `--workers N`; with `pythonpath`, the
    `llmflow` found there, e.g. another checkout's `python/`), ready to serve."""
    port = free_port()
    env = None
    if pythonpath is not None:
        env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    cmd = [sys.executable, "-m", "llmflow.cli", "serve", "--config", str(config)]
    cmd += ["--port", str(port), "--log-level", "warning"]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    name = name if workers is None else f"{name}-w{workers}"
    proc = spawn(name, cmd, port, cpus, logdir, env=env)
    wait_http(proc, "/readyz")
    return proc


def ensure_router() -> Path:
    """vllm-router from PyPI in a venv of its own (created once, then reused)."""
    exe = ROUTER_VENV / "bin" / "vllm-router"
    if exe.exists():
        return exe
    print(f"installing vllm-router=={ROUTER_VERSION} into {ROUTER_VENV} ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(ROUTER_VENV)], check=True)
    pip = [str(ROUTER_VENV / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"vllm-router=={ROUTER_VERSION}"], check=True)
    return exe


def router_command(exe: Path, port: int, backend_port: int, metrics_port: int) -> list[str]:
    """The command the issue prescribes."""
    return [
        str(exe),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--worker-urls", f"http://127.0.0.1:{backend_port}",
        "--policy", "round_robin",
        "--prometheus-port", str(metrics_port),
        "--worker-startup-check-interval", "1",
    ]  # fmt: skip


def start_router(exe: Path, backend_port: int, cpus: set[int] | None, logdir: Path) -> Proc:
    """vllm-router in front of the fake vLLM, ready once its worker passed `/health`."""
    port = free_port()
    cmd = router_command(exe, port, backend_port, free_port())
    proc = spawn("router", cmd, port, cpus, logdir)
    wait_http(proc, "/health")
    return proc
