"""A VIP client in a process of its own, timing its requests while another process floods.

`make reliability` times its VIP requests from the flood's own asyncio loop, so a VIP answer
that arrives in 1 ms still waits for that loop to finish writing and reading thousands of
crowd requests: the figure is mostly the client's. A VIP user is someone else's process (or
machine). Here the VIP client is a child process with a plain blocking keep-alive socket: it
sends one request, reads its answer to the last byte, notes the phase and the seconds, and
sends the next at once. The parent moves it between phases (`Probe.phase`); it measures only
in a named phase and hands every sample back on `Probe.stop`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.sharedctypes import Synchronized

__all__ = ["Probe"]

_IDLE, _STOP = 0, -1


def _read_answer(sock: socket.socket, buffer: bytearray) -> int:
    """Read one HTTP/1.1 answer (a Content-Length body, or a chunked one to its last chunk);
    its status."""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the VIP connection")
        buffer += chunk
    end = buffer.index(b"\r\n\r\n") + 4
    head = bytes(buffer[:end])
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    if b"transfer-encoding: chunked" in head.lower():
        # An SSE stream: its last chunk is the empty one (no chunk of an SSE event ends so).
        while (last := buffer.find(b"\r\n0\r\n\r\n", end - 2)) < 0:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("the server closed the VIP connection mid-stream")
            buffer += chunk
        del buffer[: last + 7]
        return int(head.split(b" ", 2)[1])
    while len(buffer) < end + length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the VIP connection mid-body")
        buffer += chunk
    del buffer[: end + length]
    return int(head.split(b" ", 2)[1])


def _run(
    port: int, request: bytes, cpus: set[int], phase: Synchronized[int], out: Connection
) -> None:
    os.sched_setaffinity(0, cpus)
    samples: list[tuple[int, int, float]] = []
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer = bytearray()
    try:
        while (now := phase.value) != _STOP:
            if now == _IDLE:
                time.sleep(0.001)
                continue
            start = time.perf_counter()
            sock.sendall(request)
            status = _read_answer(sock, buffer)
            samples.append((now, status, time.perf_counter() - start))
    finally:
        sock.close()
        out.send(samples)


class Probe:
    """The VIP client process: `phase(n)` measures under label n (> 0) until the next call,
    `phase(0)` pauses it, `stop()` ends it and returns `{label: [(status, seconds)]}`."""

    def __init__(self, port: int, request: bytes, cpus: set[int]) -> None:
        context = mp.get_context("spawn")
        self._phase = context.Value("i", _IDLE, lock=False)
        self._out, child = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_run, args=(port, request, cpus, self._phase, child), daemon=True
        )
        self._process.start()

    def phase(self, label: int) -> None:
        self._phase.value = label

    def stop(self) -> dict[int, list[tuple[int, float]]]:
        self._phase.value = _STOP
        samples = self._out.recv() if self._out.poll(30) else []
        self._process.join(timeout=10)
        by_phase: dict[int, list[tuple[int, float]]] = {}
        for label, status, seconds in samples:
            by_phase.setdefault(label, []).append((status, seconds))
        return by_phase
