"""Child processes the tests run as in production: `llmflow serve`, `llmflow simserve`, and
Debian's `redis-server`.

Each gets its own process group but stays in the test's session (see
`integration/vllm_server.py` on autogroup starvation), writes its log to a file the error
messages quote, and is stopped with SIGTERM first (a graceful drain), then SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import httpx
import yaml

if TYPE_CHECKING:
    from pathlib import Path
    from types import TracebackType

__all__ = [
    "GatewayProcess",
    "RedisProcess",
    "SimServeProcess",
    "free_port",
    "own_process_group",
    "replays_exactly",
    "tail",
    "wait_ready",
]


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def own_process_group() -> dict[str, Any]:
    """Popen keyword arguments that put the child in a new process group, same session."""
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"preexec_fn": os.setpgrp}  # pragma: no cover - Python 3.10


def tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"<could not read {path}: {exc}>"


def replays_exactly(trace_path: Path) -> None:
    """Assert that `llmflow trace replay` (the CLI, in a process of its own) finds every
    action of the trace again."""
    replay = subprocess.run(
        [sys.executable, "-m", "llmflow.cli", "trace", "replay", str(trace_path)],
        capture_output=True, text=True, check=False,
    )
    assert replay.returncode == 0, replay.stderr
    assert "every action matches" in replay.stdout


def wait_ready(
    process: subprocess.Popen[bytes], url: str, log_path: Path, timeout_s: float, what: str
) -> None:
    """Poll `url` until it answers 200; raise with the log's tail if the process exits first
    or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{what} exited with {process.returncode}:\n{tail(log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(url).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s:\n{tail(log_path)}")
            time.sleep(0.05)


class GatewayProcess:
    """`python -m llmflow.cli serve --config FILE --port PORT` on 127.0.0.1.

    Args:
        config: the gateway's YAML config as a mapping.
        workdir: where the config file and the log go.
        startup_timeout_s: how long to wait for `/readyz`.
        extra_args: more `llmflow serve` arguments (`--trace FILE`).
        max_open_files: the child's file-descriptor limit (`RLIMIT_NOFILE`), if set.
        pythonpath: another checkout's `python/` (its extension built) to run instead of this
            one (a benchmark's baseline).
    """

    def __init__(
        self,
        config: dict[str, Any],
        workdir: Path,
        startup_timeout_s: float = 60.0,
        extra_args: tuple[str, ...] = (),
        max_open_files: int | None = None,
        pythonpath: Path | None = None,
    ):
        self.config = config
        self.pythonpath = pythonpath
        self.max_open_files = max_open_files
        self.extra_args = extra_args
        self.port = free_port()
        self.workdir = workdir
        self.config_path = workdir / f"gateway-{self.port}.yaml"
        self.log_path = workdir / f"gateway-{self.port}.log"
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Base URL without `/v1`."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def openai_base_url(self) -> str:
        """Base URL for OpenAI clients."""
        return f"{self.url}/v1"

    def start(self) -> GatewayProcess:
        """Start the gateway and wait until it is ready; raise with the log tail otherwise."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config), encoding="utf-8")
        command = [
            sys.executable,
            "-m",
            "llmflow.cli",
            "serve",
            "--config",
            str(self.config_path),
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *self.extra_args,
        ]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._env(),
                **self._limits(),
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _env(self) -> dict[str, str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.pythonpath is not None:
            env["PYTHONPATH"] = str(self.pythonpath)
        return env

    def _limits(self) -> dict[str, Any]:
        """Popen arguments: its own process group, and the fd limit set in the child."""
        limit = self.max_open_files
        if limit is None:
            return own_process_group()

        def setup() -> None:
            os.setpgrp()
            _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))

        return {"preexec_fn": setup}

    def pid(self) -> int:
        """The process id (it must be running)."""
        assert self.process is not None
        return self.process.pid

    def _wait_ready(self) -> None:
        assert self.process is not None
        wait_ready(
            self.process, f"{self.url}/readyz", self.log_path, self.startup_timeout_s, "gateway"
        )

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM (graceful drain), then SIGKILL the group after `timeout_s`; the exit code."""
        proc = self.process
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
        self.process = None
        return code

    def state(self, client: httpx.Client | None = None) -> dict[str, Any]:
        """The gateway's `/api/state`."""
        get = client.get if client is not None else httpx.get
        response = get(f"{self.url}/api/state", timeout=5.0)
        response.raise_for_status()
        body: dict[str, Any] = response.json()
        return body

    def log_tail(self, lines: int = 60) -> str:
        """The last lines of the gateway's log."""
        return tail(self.log_path, lines)

    def __enter__(self) -> GatewayProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class SimServeProcess:
    """`python -m llmflow.cli simserve --port PORT ...`: the simulated vLLM server, alone.

    Args:
        workdir: where the log goes.
        args: more `llmflow simserve` arguments (`--speed`, `--max-num-seqs`, ...).
    """

    def __init__(self, workdir: Path, *args: str) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.args = args
        self.log_path = workdir / f"simserve-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Base URL without `/v1`."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> SimServeProcess:
        """Start it and wait until `/health` answers."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            "-m",
            "llmflow.cli",
            "simserve",
            "--port",
            str(self.port),
            *self.args,
        ]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                **own_process_group(),
            )
        try:
            wait_ready(self.process, f"{self.url}/health", self.log_path, timeout_s, "simserve")
        except BaseException:
            self.kill()
            raise
        return self

    def kill(self) -> None:
        """Stop it at once (SIGKILL): the backend dies mid-stream."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.process = None

    def __enter__(self) -> SimServeProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()


class RedisProcess:
    """Debian's `redis-server` on a free port of 127.0.0.1, with nothing saved to disk.

    Args:
        workdir: where its log goes.
    """

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.log_path = workdir / f"redis-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """`redis://127.0.0.1:PORT/0`."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisProcess:
        """Start it (again, on the same port) and wait until it answers PING."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        command = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
        ]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                **own_process_group(),
            )
        deadline = time.monotonic() + timeout_s
        while not self._pong():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not start:\n{tail(self.log_path)}")
            time.sleep(0.02)
        return self

    def _pong(self) -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
        return False

    def kill(self) -> None:
        """Stop it at once (SIGKILL): everything it held is lost."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.process = None

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()
