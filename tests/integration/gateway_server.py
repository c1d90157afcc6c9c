"""Run the real gateway (`llmflow serve --config FILE`) as a child process for integration tests.

The gateway runs in its own process, as in production: its event loop, its HTTP client to vLLM
and its scraper compete with nobody in the test's interpreter. Like the vLLM server it gets its
own process group but stays in the test's session (see `vllm_server.py` on autogroup
starvation). It is ready when `/readyz` answers 200, i.e. a scrape of vLLM succeeded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import httpx
import yaml
from vllm_server import _own_process_group, _tail, free_port

if TYPE_CHECKING:
    from pathlib import Path
    from types import TracebackType

__all__ = ["GatewayProcess", "gateway_config"]


def gateway_config(backend_url: str, *, priority: bool = False, **sections: Any) -> dict[str, Any]:
    """A gateway config for one vLLM backend serving `tiny`, with section overrides.

    Defaults that keep tests exact: chunks forwarded as they come (no coalescing). Scrapes stay
    at the default 500 ms: the scrape timeout is twice the interval, and a busy CPU vLLM can
    take over 200 ms to answer `/metrics`. Each keyword is a config section merged over these
    (one level deep).
    """
    data: dict[str, Any] = {
        "streaming": {"sse_flush_interval": 0},
        "backends": [
            {
                "name": "vllm0",
                "url": backend_url,
                "models": ["tiny"],
                "max_model_len": 2048,
                "scheduling_policy": "priority" if priority else "fcfs",
            }
        ],
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return data


class GatewayProcess:
    """`python -m llmflow.cli serve --config FILE --port PORT` on 127.0.0.1.

    Args:
        config: the gateway's YAML config as a mapping.
        workdir: where the config file and the log go.
        startup_timeout_s: how long to wait for `/readyz`.
    """

    def __init__(self, config: dict[str, Any], workdir: Path, startup_timeout_s: float = 60.0):
        self.config = config
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
        command = [sys.executable, "-m", "llmflow.cli", "serve", "--config",
                   str(self.config_path), "--port", str(self.port), "--log-level", "warning"]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=dict(os.environ, PYTHONUNBUFFERED="1"), **_own_process_group(),
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"gateway exited with {self.process.returncode}:\n{_tail(self.log_path)}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/readyz").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"gateway not ready:\n{_tail(self.log_path)}")
                time.sleep(0.1)

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
        return _tail(self.log_path, lines)

    def __enter__(self) -> GatewayProcess:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
