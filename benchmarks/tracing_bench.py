"""What a traced request costs the gateway's process: its spans made, filled and exported.

`telemetry: {otlp_endpoint}` gives each governed request a `llmflow.request` span and an
`llmflow.upstream` child (plus `llmflow.queue` when it waited); the SDK's batch processor
encodes and posts them from a thread of its own, which shares the process (and the GIL) with
the event loop. This script drives `Tracing` the way a session does (`upstream_began`, then
`ended`) for `--requests` stand-in sessions, with a collector in another process that accepts
every POST and decodes nothing, and reports the process's CPU seconds per request
(`time.process_time`: the loop's work and the exporter thread's, not the machine's other load),
beside the same figure for a request the native front served (its record read as
`NativeInbox` reads it, its finished spans built by `Tracing.served`) and for one bare SDK span
started and ended, the floor any tracer pays.

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
from llmflow.gateway.native import served
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


def _record(request_id: int) -> dict[str, object]:
    """A native request's record (`NativeRoutes.take`), sampled, as the front sends it."""
    trace = {
        "trace_id": (request_id << 64) | 0xABCDEF, "span_id": 1 + request_id,
        "queue_span_id": 2 + request_id, "upstream_span_id": 3 + request_id,
        "parent_span_id": None, "parent_flags": 0, "flags": 3,
    }
    return {
        "id": request_id, "tenant": "acme", "tier": "normal",
        "arrived_us": 1_000_000, "started_us": 1_000_050, "first_token_us": 1_100_000,
        "ended_us": 2_000_000, "prompt_tokens": 120, "max_tokens": 256,
        "completion_tokens": 256, "end": "completed", "error": None, "retry_after_s": None,
        "refused": False, "truncated": False, "upstream_aborted": False, "backend": "gpu0",
        "path": "/v1/chat/completions", "stream": True, "model": "m", "queue_wait_us": 0,
        "brownout_max_tokens": None, "trace": trace,
    }


async def _traced(url: str, requests: int, rounds: int, native: bool) -> list[float]:
    tracing = Tracing(Telemetry(otlp_endpoint=url))
    loop = asyncio.get_running_loop()
    per_request = []
    for r in range(rounds):
        if native:
            records = [_record(r * requests + i) for i in range(requests)]
        else:
            sessions = [_session(loop, r * requests + i) for i in range(requests)]
        began = time.process_time()
        for i in range(1, requests + 1):
            if native:
                record = served(records[i - 1])
                assert record.trace is not None
                tracing.served(record, record.trace, refused=False)
            else:
                tracing.upstream_began(sessions[i - 1])  # type: ignore[arg-type]
                tracing.ended(sessions[i - 1])  # type: ignore[arg-type]
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
        url = f"http://127.0.0.1:{port}"
        rounds = asyncio.run(_traced(url, args.requests, args.rounds, native=False))
        native = asyncio.run(_traced(url, args.requests, args.rounds, native=True))
    finally:
        sink.terminate()
        sink.wait()
    bare = _bare_span_us(args.requests)
    for name, figures in (("traced request:", rounds), ("native record: ", native)):
        print(f"{name} {statistics.median(figures):.1f} us CPU (median of {args.rounds}; "
              f"rounds {', '.join(f'{r:.1f}' for r in figures)})")
    print(f"bare SDK span:  {bare:.1f} us CPU")


if __name__ == "__main__":
    main()
