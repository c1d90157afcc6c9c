"""A gateway seen from outside: `llmflow serve` as a real process in front of a fake vLLM.

The fake runs in a thread of the test process (its own event loop and uvicorn server), so a
synchronous test, such as a hypothesis or schemathesis one, reads the fake's counters directly
while it talks to the gateway over loopback like any client.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import uvicorn

from tests.processes import GatewayProcess

from .fake_vllm import FakeVllm

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

__all__ = ["Outside", "assert_openai_error", "outside_gateway"]

TENANT_KEY = "tk-1f3a9c0e7b2d4a68b5c1"  # distinctive: tests grep outputs for it
ADMIN_KEY = "ak-88c2e4b0d9a7f6135e2c"


@contextlib.contextmanager
def fake_in_thread() -> Iterator[tuple[str, FakeVllm]]:
    """Serve a `FakeVllm` on 127.0.0.1 from a thread; yields (base URL, fake)."""
    fake = FakeVllm()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(fake.app, log_level="critical", lifespan="off", access_log=False)
    server = uvicorn.Server(config)  # off the main thread it leaves signals alone
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive(), "fake vLLM exited"
        assert time.monotonic() < deadline, "fake vLLM did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", fake
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


class Outside:
    """A running `llmflow serve` process over a fake vLLM in this process."""

    def __init__(self, gateway: GatewayProcess, fake: FakeVllm) -> None:
        self.gateway, self.fake = gateway, fake
        self.url = gateway.url

    def settled(self, timeout_s: float = 10.0) -> bool:
        """Wait until the fake has nothing running (every upstream request ended)."""
        deadline = time.monotonic() + timeout_s
        while self.fake.running and time.monotonic() < deadline:
            time.sleep(0.005)
        return self.fake.running == 0


@contextlib.contextmanager
def outside_gateway(
    workdir: Path, extra_args: tuple[str, ...] = (), **sections: Any
) -> Iterator[Outside]:
    """`llmflow serve` (real process, real loopback) over a threaded fake vLLM."""
    with fake_in_thread() as (url, fake):
        config: dict[str, Any] = {
            "backends": [
                {"name": "b0", "url": url, "models": ["fake-model"], "max_model_len": 4096}
            ],
            "metrics": {"scrape_interval_ms": 100, "stale_after_ms": 5000},
            "streaming": {"sse_flush_interval": 0},
            **sections,
        }
        with GatewayProcess(config, workdir, extra_args=extra_args) as gateway:
            yield Outside(gateway, fake)


def assert_openai_error(status: int, body: bytes, content_type: str | None) -> dict[str, Any]:
    """An error answer is OpenAI's JSON shape, with a message a person can act on."""
    assert (content_type or "").startswith("application/json"), (status, body[:200])
    error = json.loads(body)["error"]
    assert set(error) >= {"message", "type", "code"}, error
    assert isinstance(error["message"], str), error
    assert len(error["message"]) >= 10, error
    assert isinstance(error["code"], str), error
    assert error["code"], error
    assert error["type"] != "server_error" or status >= 500, error
    return error  # type: ignore[no-any-return]
