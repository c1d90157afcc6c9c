"""What the native front door adds to a request it passes to the app.

Two real `llmflow serve` processes (the built-in simulated backend), one on the Python
listener (`server.front: python`: uvicorn on the port) and one behind the front door
(`server.front: native`: the front on the port, uvicorn on a private unix socket); one client
sends small `GET /health` requests back to back on one keep-alive connection to each, in turns,
and prints each side's per-request latency (median, p90, p99) and the difference of medians:
the pass-through's added latency.

Usage: `python -m benchmarks.front_latency [--requests 2000] [--rounds 3]`.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import time
from pathlib import Path

from tests.processes import GatewayProcess

_REQUEST = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
_REPLY_END = b'{"status":"ok"}'


def _timings(port: int, n: int) -> list[float]:
    """Seconds per request, for `n` requests on one keep-alive connection."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out = []
        for _ in range(n):
            start = time.perf_counter()
            sock.sendall(_REQUEST)
            got = b""
            while not got.endswith(_REPLY_END):
                chunk = sock.recv(65536)
                assert chunk, "the gateway closed the connection"
                got += chunk
            out.append(time.perf_counter() - start)
        return out


def _summary(samples: list[float]) -> str:
    q = [x * 1e6 for x in statistics.quantiles(samples, n=100)]
    median = statistics.median(samples) * 1e6
    return f"median {median:7.1f} us  p90 {q[89]:7.1f}  p99 {q[98]:7.1f}"


def main() -> None:
    """Run both gateways, time them in turns, print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per round and side")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sides = {
            front: GatewayProcess({"server": {"front": front}}, Path(tmp)).start()
            for front in ("python", "native")
        }
        try:
            samples: dict[str, list[float]] = {front: [] for front in sides}
            for _ in range(args.rounds):
                for front, gateway in sides.items():
                    _timings(gateway.port, 200)  # warm-up
                    samples[front] += _timings(gateway.port, args.requests)
        finally:
            for gateway in sides.values():
                gateway.stop()
    for front, values in samples.items():
        print(f"{front:>6}: {_summary(values)}  ({len(values)} requests)")
    added = statistics.median(samples["native"]) - statistics.median(samples["python"])
    print(f"added by the front door (difference of medians): {added * 1e6:.1f} us")


if __name__ == "__main__":
    main()
