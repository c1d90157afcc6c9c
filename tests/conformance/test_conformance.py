"""`llmflow conformance` (the command, in a process of its own) against llmflow itself, and
against a bare pass-through proxy, to show the suite can fail.

Each test starts the command first: its fake vLLM listens on a port chosen here, the gateway
under test is configured with that port, then started; the command waits for it to serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import uvicorn

from tests.conformance import llmflow_config
from tests.processes import GatewayProcess, free_port, own_process_group, tail

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from starlette.types import Receive, Scope, Send

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

KEYS = {"normal": "k-conf-normal-5f1c", "vip": "k-conf-vip-93ab", "batch": "k-conf-batch-07de"}
ROWS = [
    "every request ends exactly once",
    "concurrency cap holds",
    "bounded queue: fast refusal",
    "Retry-After on every 429",
    "never a 500 for backpressure",
    "a leaving client frees its slot",
    "a stalled client loses its slot",
    "a stalled client costs bounded memory",
    "VIP served during a batch flood",
    "no leak",
]


class Conformance:
    """`llmflow conformance URL` with its backend on `port`, started at once; `finish` waits
    for it (the gateway under test starts in between) and reads its exit code and report."""

    def __init__(self, tmp_path: Path, url: str, port: int, *args: str) -> None:
        self.report = tmp_path / f"conformance-{port}.json"
        self.log = tmp_path / f"conformance-{port}.log"
        backend = ["--backend-port", str(port)] if "--backend" not in args else []
        command = [sys.executable, "-m", "llmflow.cli", "conformance", url, *backend,
                   "--json", str(self.report), "--wait", "60", *args]
        self.process = _spawn(command, self.log)
        try:
            _wait_listening(port, self.process, self.log)
        except BaseException:
            _kill(self.process)
            raise

    def finish(self) -> dict[str, Any]:
        """The exit code, the JSON report and its rows by name, and the log's tail."""
        try:
            code = self.process.wait(timeout=150)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        assert self.report.exists(), f"no report (exit {code}):\n{tail(self.log)}"
        report = json.loads(self.report.read_text())
        rows = {r["invariant"]: r for r in report["rows"]}
        return {"code": code, "report": report, "rows": rows, "log": tail(self.log, 80)}


def _spawn(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, **own_process_group())


def _kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()


@contextlib.contextmanager
def standing_backend(tmp_path: Path, port: int) -> Iterator[None]:
    """`llmflow conformance-backend --port PORT` in a process of its own."""
    log = tmp_path / f"conformance-backend-{port}.log"
    process = _spawn([sys.executable, "-m", "llmflow.cli", "conformance-backend", "--port",
                      str(port)], log)
    try:
        _wait_listening(port, process, log)
        yield
    finally:
        _kill(process)


def _wait_listening(port: int, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        assert process.poll() is None, f"conformance exited:\n{tail(log)}"
        assert time.monotonic() < deadline, f"the backend did not listen:\n{tail(log)}"
        time.sleep(0.05)


def test_llmflow_passes_every_invariant(tmp_path: Path) -> None:
    port = free_port()
    config = llmflow_config(port, KEYS)  # batch may borrow every slot: see there
    gateway = GatewayProcess(config, tmp_path)
    args = ("--max-concurrency", "4", "--api-key", KEYS["normal"], "--vip-key", KEYS["vip"],
            "--batch-key", KEYS["batch"], "--stall-within", "5")
    suite = Conformance(tmp_path, gateway.url, port, *args)
    with gateway:
        result = suite.finish()
    assert result["code"] == 0, result["log"]
    assert list(result["rows"]) == ROWS
    assert {name: row["status"] for name, row in result["rows"].items()} == dict.fromkeys(
        ROWS, "pass"
    ), result["log"]
    assert result["report"]["passed"] is True


class BareProxy:
    """A minimal pass-through proxy: at most `limit` requests in flight, a bare 429 (no
    Retry-After) beyond, nothing told upstream when a client leaves."""

    def __init__(self, upstream: str, limit: int) -> None:
        self.upstream, self.limit, self.in_flight = upstream, limit, 0
        self.client: httpx.AsyncClient | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if self.in_flight >= self.limit:
            await send({"type": "http.response.start", "status": 429,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"error": {"message": "busy"}}'})
            return
        self.in_flight += 1
        try:
            await self._forward(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if self.client is None:
            self.client = httpx.AsyncClient(timeout=None)
        request = self.client.build_request(
            scope["method"], self.upstream + scope["path"], content=body,
            headers={"content-type": "application/json"},
        )
        response = await self.client.send(request, stream=True)
        try:
            headers = [(b"content-type", response.headers["content-type"].encode())]
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": headers})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()

    async def serve(self, server: uvicorn.Server, sock: socket.socket) -> None:
        """`server.serve`, then the upstream connections closed in the same loop (left to the
        collector, each would warn of an unclosed transport inside whichever test runs next)."""
        try:
            await server.serve(sockets=[sock])
        finally:
            if self.client is not None:
                await self.client.aclose()


@contextlib.contextmanager
def serve_in_thread(app: BareProxy) -> Iterator[str]:
    """Serve `app` on 127.0.0.1 from a thread; yields its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="critical", lifespan="off", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=asyncio.run, args=(app.serve(server, sock),), daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


def test_a_bare_proxy_fails_the_cap_retry_after_and_disconnect_rows(tmp_path: Path) -> None:
    # Claimed: a cap of 4. The proxy lets 8 through, answers 429 without Retry-After beyond,
    # and never closes upstream when its client leaves.
    # The suite's backend stands in a process of its own here (`conformance-backend`, read
    # through `--backend URL`), as for a gateway configured before the suite runs.
    port = free_port()
    backend = f"http://127.0.0.1:{port}"
    # The backend first: the proxy's port, picked after, cannot be the one free_port gave.
    with standing_backend(tmp_path, port), serve_in_thread(BareProxy(backend, limit=8)) as url:
        args = ("--max-concurrency", "4", "--stall-within", "2", "--abort-within", "0.5",
                "--settle", "1", "--backend", backend)
        result = Conformance(tmp_path, url, port, *args).finish()
    rows = result["rows"]
    assert result["code"] == 1, result["log"]
    assert rows["concurrency cap holds"]["status"] == "fail", rows
    assert rows["concurrency cap holds"]["measured"].startswith("backend peak 8 running")
    assert rows["Retry-After on every 429"]["status"] == "fail", rows
    assert rows["a leaving client frees its slot"]["status"] == "fail", rows
    assert rows["VIP served during a batch flood"]["status"] == "n/a", rows
    assert rows["every request ends exactly once"]["status"] == "pass", rows
    assert result["report"]["passed"] is False

