"""A small OTLP/HTTP trace receiver for tests: what an OpenTelemetry collector would be given.

It serves `POST /v1/traces` on loopback in a thread of its own (the gateway's exporter posts
from its own thread, and its last batch at shutdown must not wait on the test's event loop),
decodes each `ExportTraceServiceRequest` with `opentelemetry-proto`, and keeps every span and
the raw bodies, so a test can read what was sent from outside the gateway.
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

    from opentelemetry.proto.common.v1.common_pb2 import AnyValue

__all__ = ["ExportedSpan", "OtlpReceiver"]


@dataclass(frozen=True)
class ExportedSpan:
    """One span as it was exported."""

    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int  # 0 unset, 1 ok, 2 error
    service: str


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    return getattr(v, which) if which is not None else None


class OtlpReceiver:
    """`with OtlpReceiver() as rx:` serves `rx.url`; `rx.spans` holds what arrived."""

    def __init__(self) -> None:
        self.spans: list[ExportedSpan] = []
        self.bodies: list[bytes] = []  # raw protobuf, as posted (decompressed)
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length", "0")))
                if self.headers.get("content-encoding") == "gzip":
                    raw = gzip.decompress(raw)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                receiver._take(raw)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        """The collector's base URL (the gateway adds `/v1/traces`)."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _take(self, raw: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(raw)
        with self._lock:
            self.bodies.append(raw)
            self.spans.extend(_spans_of(request))

    def named(self, name: str) -> list[ExportedSpan]:
        """The spans called `name`."""
        with self._lock:
            return [s for s in self.spans if s.name == name]

    def children(self, parent: ExportedSpan) -> list[ExportedSpan]:
        """The spans whose parent is `parent`."""
        with self._lock:
            return [
                s
                for s in self.spans
                if s.trace_id == parent.trace_id and s.parent_span_id == parent.span_id
            ]


def _spans_of(request: ExportTraceServiceRequest) -> Iterator[ExportedSpan]:
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                yield ExportedSpan(
                    name=span.name,
                    trace_id=span.trace_id.hex(),
                    span_id=span.span_id.hex(),
                    parent_span_id=span.parent_span_id.hex(),
                    kind=span.kind,
                    start_ns=span.start_time_unix_nano,
                    end_ns=span.end_time_unix_nano,
                    attributes={a.key: _value(a.value) for a in span.attributes},
                    status_code=span.status.code,
                    service=str(resource.get("service.name", "")),
                )
