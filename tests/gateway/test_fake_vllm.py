"""The fake vLLM's own instrument: peak running counts the requests a client holds open.

A request whose connection the client has closed is not counted against the next one, even
before the fake's event loop has noticed the close (vLLM's API server aborts it first); one
still open is, however briefly. Checked here with raw sockets and no gateway in between.
"""

from __future__ import annotations

import json
import socket

import pytest

from tests.reliability.wire import post_bytes

from .fake_vllm import FakeVllm
from .harness import serve_asgi, until

pytestmark = pytest.mark.anyio

HELD = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4,
    "stream": True,
    "fake": {"step": True},  # no token until released: the request stays running
}


def _open(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(post_bytes("/v1/chat/completions", json.dumps(HELD).encode()))
    return sock


async def test_peak_running_leaves_out_a_request_already_closed() -> None:
    fake = FakeVllm()
    async with serve_asgi(fake.app) as (url, _):
        a, b = _open(url), _open(url)
        await until(lambda: fake.running == 2)
        a.close()
        c = _open(url)  # sent after a's FIN: a is vLLM's to abort, not c's rival
        await until(lambda: fake.seen == 3)
        await until(lambda: fake.running == 2)
        assert fake.peak_running == 2
        d = _open(url)  # b and c are open: three at once
        await until(lambda: fake.running == 3)
        assert fake.peak_running == 3
        for sock in (b, c, d):
            sock.close()
        await until(lambda: fake.running == 0)
        assert fake.aborted == 4
