"""OpenTelemetry traces (`telemetry: {otlp_endpoint: ...}`): one span per governed request.

Each request the runtime governs gets a `llmflow.request` span (kind SERVER) from its arrival
to its end, with the runtime's decision as attributes (tenant, tier, queued time, reason,
Retry-After, backend, truncation, outcome; in shadow mode what the policy would have done), and
two children: `llmflow.queue` (arrival to start, or to the refusal of a request that waited)
and `llmflow.upstream` (kind CLIENT, from the request going out to vLLM to the reply's end). The
upstream span's context goes to vLLM as W3C `traceparent`, so vLLM's own spans
(`--otlp-traces-endpoint`) are its children; a client's incoming `traceparent` is continued
(the request span is its child). Sampling is the parent's choice when a client sent one, else
`sample_ratio` of the trace ids (`TraceIdRatioBased`).

One set of spans, two ways of making them. A request Python serves gets them from the SDK's
tracer, built from the session's own timestamps when it ends, except the upstream span, which
exists from the moment the Python reader sends its `traceparent`. A completion the native front
serves never reaches Python on the wire: the front decides its trace as the SDK would
(`rust/src/front/traceparent.rs`: the client's `traceparent` read as the propagator reads it,
new trace ids sampled as the sampler samples them), sends the upstream span's `traceparent`
itself, and puts the ids in the request's record; `Tracing.served` builds the same three spans
from that record, with the same attributes, and hands them to the span processor finished.

Nothing of the prompt, the reply or the API key is an attribute. The SDK's batch processor
exports over OTLP/HTTP (protobuf) in a thread of its own; the event loop only queues finished
spans.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmflow.gateway.errors import GatewayError
from llmflow.gateway.metrics import outcome_of

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span

    from llmflow.config import Telemetry
    from llmflow.gateway.native import Served
    from llmflow.gateway.session import Prepared, StreamSession
    from llmflow.gateway.shadow import Verdict

__all__ = ["NativeTrace", "Tracing", "otlp_traces_url"]

_TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for traces
_SCOPE = "llmflow.gateway"  # the instrumentation scope of every span
_CUT_OUTCOMES = frozenset(("completed", "error", "timeout", "cancelled", "running"))
_MISSING_EXTRA = (
    "telemetry.otlp_endpoint is set but OpenTelemetry is not installed: "
    "pip install 'llmflow[otel]' (opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http)"
)


def otlp_traces_url(endpoint: str) -> str:
    """The collector's traces URL: `endpoint` as given when it names `/v1/traces`, else with it."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith(_TRACES_PATH) else endpoint + _TRACES_PATH


class Tracing:
    """The gateway's tracer: spans for sessions and refusals, exported over OTLP/HTTP.

    Args:
        config: the `telemetry` section (its `otlp_endpoint` set).

    Raises:
        RuntimeError: OpenTelemetry is not installed (the message says which extra).
    """

    def __init__(self, config: Telemetry) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
            from opentelemetry.sdk.util.instrumentation import InstrumentationScope
            from opentelemetry.trace import (
                SpanContext,
                SpanKind,
                Status,
                StatusCode,
                TraceFlags,
                set_span_in_context,
            )
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as exc:
            raise RuntimeError(_MISSING_EXTRA) from exc
        assert config.otlp_endpoint is not None
        self.sample_ratio = config.sample_ratio  # the native front samples by it too
        self._resource = Resource.create({"service.name": config.service_name})
        self._provider = TracerProvider(
            resource=self._resource,
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
        )
        exporter = OTLPSpanExporter(endpoint=otlp_traces_url(config.otlp_endpoint))
        # The one processor: the tracer's spans reach it as they end, the native ones from
        # `served`.
        self._processor = BatchSpanProcessor(exporter)
        self._provider.add_span_processor(self._processor)
        self._tracer = self._provider.get_tracer(_SCOPE)
        self._scope = InstrumentationScope(_SCOPE)
        self._propagator = TraceContextTextMapPropagator()
        self._kind, self._status, self._code = SpanKind, Status, StatusCode
        self._kinds = {"llmflow.request": SpanKind.SERVER, "llmflow.upstream": SpanKind.CLIENT}
        self._readable, self._span_context, self._flags = ReadableSpan, SpanContext, TraceFlags
        self._in_context = set_span_in_context
        self._live: dict[int, _Spans] = {}  # request id -> its spans, until it ends
        self._epoch_ns = time.time_ns() - time.monotonic_ns()  # the sessions' clock to Unix

    def _ns(self, monotonic_s: float) -> int:
        return self._epoch_ns + int(monotonic_s * 1e9)

    def _parent(self, prepared: Prepared) -> Context | None:
        if prepared.traceparent is None:
            return None
        return self._propagator.extract({"traceparent": prepared.traceparent})

    def _spans(self, session: StreamSession) -> _Spans:
        spans = self._live.get(session.request_id)
        if spans is None:
            p = session.prepared
            root = self._tracer.start_span(
                "llmflow.request",
                context=self._parent(p),
                kind=self._kind.SERVER,
                start_time=self._ns(p.arrived),
            )
            spans = self._live[session.request_id] = _Spans(root)
        return spans

    def upstream_began(self, session: StreamSession) -> str | None:
        """The request is going out to vLLM now: open its upstream span.

        Returns:
            Its W3C `traceparent`, for the upstream request's head (None when not sampled).
        """
        spans = self._spans(session)
        if spans.upstream is None:
            spans.upstream = self._tracer.start_span(
                "llmflow.upstream",
                context=self._in_context(spans.root),
                kind=self._kind.CLIENT,
                attributes={"llmflow.backend": session.backend or ""},
            )
        if not spans.upstream.get_span_context().is_valid:
            return None
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._in_context(spans.upstream))
        return carrier.get("traceparent")

    def ended(self, session: StreamSession) -> None:
        """A session is over: its spans get their attributes and end."""
        spans = self._spans(session)
        del self._live[session.request_id]
        now = time.monotonic()
        p = session.prepared
        started = session.backend is not None
        queue_end = p.arrived + session.queue_wait_s if started else now
        if not started or session.queue_wait_s > 0:
            self._queue_span(spans.root, p.arrived, queue_end)
        if spans.upstream is not None:
            spans.upstream.end(end_time=self._ns(now))
        root = spans.root
        if root.is_recording():  # sampled: the decision goes on it in one call
            attributes, failed = _ended_attributes(session)
            root.set_attributes(attributes)
            if failed:
                root.set_status(self._status(self._code.ERROR, session.end))
        root.end(end_time=self._ns(now))

    def refused(self, prepared: Prepared, error: GatewayError, request_id: str | None) -> None:
        """A request refused as it arrived (no session)."""
        now = time.monotonic()
        root = self._tracer.start_span(
            "llmflow.request",
            context=self._parent(prepared),
            kind=self._kind.SERVER,
            start_time=self._ns(prepared.arrived),
        )
        root.set_attributes(_refused_attributes(prepared, error, request_id))
        root.end(end_time=self._ns(now))

    def served(self, session: Served, trace: NativeTrace, refused: bool) -> None:
        """A request the native front served has ended: its spans, from its record.

        They are those `ended` (or, `refused` as it arrived, `refused`) makes of a session,
        with the ids the front decided and sent upstream, handed to the span processor
        finished. An unsampled trace exports nothing (vLLM was told so: its sampled flag clear).
        """
        if not trace.sampled:
            return
        p = session.prepared
        began = self._ns(p.arrived)
        ended = self._ns(session.ended_at if session.ended_at is not None else p.arrived)
        root = self._context(trace.trace_id, trace.span_id, trace.flags)
        parent = None
        if trace.parent_span_id is not None:  # the client's span, as the propagator read it
            parent = self._context(
                trace.trace_id, trace.parent_span_id, trace.parent_flags, remote=True
            )
        status = None
        if refused and session.error is not None:
            request_id = session.error.headers.get("X-Request-Id")
            attributes = _refused_attributes(p, session.error, request_id)  # type: ignore[arg-type]
        else:
            attributes, failed = _ended_attributes(session)  # type: ignore[arg-type]
            if failed:
                status = self._status(self._code.ERROR, session.end)
            self._native_children(session, trace, root, began, ended)
        self._finish("llmflow.request", root, parent, began, ended, attributes, status)

    def _native_children(
        self, session: Served, trace: NativeTrace, root: Any, began: int, ended: int
    ) -> None:
        p = session.prepared
        started = session.backend is not None
        if not started or session.queue_wait_s > 0:  # as `ended` makes them
            queue_end = self._ns(p.arrived + session.queue_wait_s) if started else ended
            queue = self._context(trace.trace_id, trace.queue_span_id, trace.flags)
            self._finish("llmflow.queue", queue, root, began, queue_end, {}, None)
        if session.started_at is not None:
            upstream = self._context(trace.trace_id, trace.upstream_span_id, trace.flags)
            attributes = {"llmflow.backend": session.backend or ""}
            began = self._ns(session.started_at)
            self._finish("llmflow.upstream", upstream, root, began, ended, attributes, None)

    def _context(self, trace_id: int, span_id: int, flags: int, remote: bool = False) -> Any:
        trace_flags = self._flags(flags)
        return self._span_context(trace_id, span_id, is_remote=remote, trace_flags=trace_flags)

    def _finish(
        self,
        name: str,
        context: Any,
        parent: Any,
        began: int,
        ended: int,
        attributes: dict[str, Any],
        status: Any,
    ) -> None:
        span = self._readable(
            name=name,
            context=context,
            parent=parent,
            resource=self._resource,
            attributes=attributes,
            kind=self._kinds.get(name, self._kind.INTERNAL),
            status=status if status is not None else self._status(self._code.UNSET),
            start_time=began,
            end_time=ended,
            instrumentation_scope=self._scope,
        )
        self._processor.on_end(span)

    def _queue_span(self, root: Span, began: float, ended: float) -> None:
        span = self._tracer.start_span(
            "llmflow.queue", context=self._in_context(root), start_time=self._ns(began)
        )
        span.end(end_time=self._ns(ended))

    def close(self) -> None:
        """Export what is left and stop (blocking: run it off the event loop)."""
        for spans in list(self._live.values()):  # requests cut off by the shutdown
            if spans.upstream is not None:
                spans.upstream.end()
            spans.root.end()
        self._live.clear()
        self._provider.shutdown()


@dataclass(frozen=True, slots=True)
class NativeTrace:
    """A native request's trace, as the front decided it (its record's `trace`)."""

    trace_id: int
    span_id: int  # llmflow.request's
    queue_span_id: int
    upstream_span_id: int  # sent to vLLM in its `traceparent`
    parent_span_id: int | None  # the client's span, when its `traceparent` was continued
    parent_flags: int  # the client's trace flags
    flags: int  # its own spans' (sampled, random trace id), as in the `traceparent` sent

    @property
    def sampled(self) -> bool:
        """Its spans are exported."""
        return bool(self.flags & 0x01)


class _Spans:
    __slots__ = ("root", "upstream")

    def __init__(self, root: Span) -> None:
        self.root = root
        self.upstream: Span | None = None


def _prepared_attributes(p: Prepared) -> dict[str, Any]:
    # Counts and names only: never the prompt, the reply or the API key.
    attributes: dict[str, Any] = {
        "llmflow.tenant": p.tenant,
        "llmflow.tier": p.tier,
        "llmflow.endpoint": p.path,
        "llmflow.stream": p.options.stream,
        "llmflow.prompt_tokens": p.prompt_tokens,
        "llmflow.max_tokens": p.max_tokens,
    }
    if p.model is not None:
        attributes["llmflow.model"] = p.model
    return attributes


def _refused_attributes(
    prepared: Prepared, error: GatewayError, request_id: str | None
) -> dict[str, Any]:
    attributes = _prepared_attributes(prepared)
    if request_id is not None:
        attributes["llmflow.request_id"] = request_id
    attributes |= _error_attributes(error)
    attributes["http.response.status_code"] = error.status
    attributes["llmflow.outcome"] = "rejected"
    return attributes


def _ended_attributes(session: StreamSession) -> tuple[dict[str, Any], bool]:
    """The request span's attributes at its end, and whether it failed (status ERROR)."""
    attributes = _request_attributes(session)
    error = session.error or _refusal_of(session)
    if error is not None:
        attributes |= _error_attributes(error)
    elif session.end not in _CUT_OUTCOMES:
        attributes["llmflow.truncated"] = session.end  # a cut, with its notice
    attributes["http.response.status_code"] = error.status if error else 200
    outcome = attributes["llmflow.outcome"] = outcome_of(session)[0]
    failed = outcome == "failed" or (error is not None and error.status >= 500)
    if session.shadow is not None:
        attributes |= _shadow_attributes(session.shadow)
    return attributes, failed


def _request_attributes(session: StreamSession) -> dict[str, Any]:
    attributes = _prepared_attributes(session.prepared)
    attributes["llmflow.request_id"] = f"llmflow-{session.request_id}"
    attributes["llmflow.reason"] = session.end
    attributes["llmflow.output_tokens"] = session.parser.completion_tokens
    if session.backend is not None:
        attributes["llmflow.backend"] = session.backend
        attributes["llmflow.queued_s"] = session.queue_wait_s
        start = session.start_action
        if start is not None and start.max_tokens is not None:
            attributes["llmflow.brownout_max_tokens"] = start.max_tokens
    return attributes


def _error_attributes(error: GatewayError) -> dict[str, Any]:
    attributes: dict[str, Any] = {"llmflow.reason": error.code}
    retry_after = error.headers.get("Retry-After")
    if retry_after is not None:
        attributes["llmflow.retry_after_s"] = int(retry_after)
    return attributes


def _refusal_of(session: StreamSession) -> GatewayError | None:
    """The runtime's `Reply` to a request that waited (refused from the queue), if any."""
    admitted = session.admitted
    if not admitted.done() or admitted.cancelled():
        return None
    exc = admitted.exception()
    return exc if isinstance(exc, GatewayError) else None


def _shadow_attributes(verdict: Verdict) -> dict[str, Any]:
    attributes: dict[str, Any] = {"llmflow.shadow.verdict": verdict.summary()}
    for key, value in (
        ("reason", verdict.reason),
        ("retry_after_s", verdict.retry_after_s),
        ("status", verdict.status),
        ("backend", verdict.backend),
    ):
        if value is not None:
            attributes[f"llmflow.shadow.{key}"] = value
    return attributes
