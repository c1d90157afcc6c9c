"""What a traced request costs the gateway's process: its spans made, filled and exported.

`telemetry: {otlp_endpoint}` gives each governed request a `llmflow.request` span and an
`llmflow.upstream` child (plus `llmflow.queue` when it waited); the SDK's batch processor
encodes and posts them from a thread of its own, which shares the process (and the GIL) with
the event loop. This script drives `Tracing` the way a session does (`upstream_began`, then
`ended`) for `--requests` stand-in sessions, with a collector in another process that accepts
every POST and decodes nothing, and reports the process's CPU seconds per request
(`time.process_time`: the loop's work and the exporter thread's, not the machine's other load),
beside the same figure for one bare SDK span started and ended, the floor any tracer pays.

Usage: `python -m benchmarks.tracing_bench [--requests 20000] [--rounds 5]`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

from llmflow.config import Telemetry
from llmflow.gateway.session import Prepared
from llmflow.gateway.streaming import ClientOptions
from llmflow.gateway.telemetry import Tracing

_FLUSH_EVERY = 500  # requests (1,000 spans) between flushes; the SDK's queue holds 2,048
_SINK = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self.send_response(200); self.send_header("content-length", "0"); self.end_headers()
    def log_message(self, *a): pass
server = ThreadingHTTPServer(("127.0.0.1", 0), H)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def _session(loop: asyncio.AbstractEventLoop, request_id: int) -> SimpleNamespace:
    admitted = loop.create_future()
    admitted.set_result(None)
    options = ClientOptions("chat", "m", True, 1, False, False)
    prepared = Prepared(options, "acme", "normal", "/v1/chat/completions", {}, 120, 256, "m")
    return SimpleNamespace(
        request_id=request_id, prepared=prepared, backend="gpu0", queue_wait_s=0.0,
        error=None, end="completed", parser=SimpleNamespace(completion_tokens=256),
        start_action=None, admitted=admitted, shadow=None,
    )


async def _traced(url: str, requests: int, rounds: int) -> list[float]:
    tracing = Tracing(Telemetry(otlp_endpoint=url))
    loop = asyncio.get_running_loop()
    per_request = []
    for r in range(rounds):
        sessions = [_session(loop, r * requests + i) for i in range(requests)]
        began = time.process_time()
        for i, session in enumerate(sessions, 1):
            tracing.upstream_began(session)  # type: ignore[arg-type]
            tracing.ended(session)  # type: ignore[arg-type]
            if i % _FLUSH_EVERY == 0:  # within the SDK's queue: no span is dropped uncounted
                tracing._provider.force_flush()
        tracing._provider.force_flush()  # the export of this round's spans is counted too
        per_request.append((time.process_time() - began) / requests * 1e6)
    tracing.close()
    return per_request


def _bare_span_us(n: int) -> float:
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("bench")
    began = time.process_time()
    for _ in range(n):
        tracer.start_span("span").end()
    return (time.process_time() - began) / n * 1e6


def main() -> None:
    """Run the benchmark and print its figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    sink = subprocess.Popen([sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout is not None
        port = int(sink.stdout.readline())
        rounds = asyncio.run(_traced(f"http://127.0.0.1:{port}", args.requests, args.rounds))
    finally:
        sink.terminate()
        sink.wait()
    bare = _bare_span_us(args.requests)
    print(f"traced request: {statistics.median(rounds):.1f} us CPU (median of {args.rounds}; "
          f"rounds {', '.join(f'{r:.1f}' for r in rounds)})")
    print(f"bare SDK span:  {bare:.1f} us CPU")


if __name__ == "__main__":
    main()
