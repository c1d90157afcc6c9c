"""OpenTelemetry traces, read from outside: what a collector receives, and what vLLM received.

A small OTLP/HTTP receiver (`otlp_receiver.py`, decoding `opentelemetry-proto`) stands in for
the collector; the fake vLLM keeps every request's headers. Each check ties the two together:
the span the gateway exported for a request, and the `traceparent` vLLM got for it, share the
trace id, and vLLM's parent is the gateway's upstream span.

Each check runs on both paths: the completions the native front serves (it decides the trace
ids, sends the `traceparent`, and Python builds the spans from the request's record) and those
Python serves (the app served alone), and one compares what the two export for the same
requests. The front's reading of a client's `traceparent` and its sampling rule are held
against the SDK's own on many inputs.
"""

from __future__ import annotations

import json
import random
from typing import TYPE_CHECKING, Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import Decision, ParentBased, TraceIdRatioBased
from opentelemetry.trace import get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from llmflow._core import front_trace_sampled, front_traceparent

from .both_paths import on_each_path, paths
from .goldens import plain, with_reference
from .harness import served_by, start_gateway
from .otlp_receiver import OtlpReceiver

if TYPE_CHECKING:
    import httpx

    from .harness import Harness
    from .otlp_receiver import ExportedSpan

pytestmark = pytest.mark.anyio

ALPHA_KEY = "ak-telemetry-alpha-000001"
BETA_KEY = "ak-telemetry-beta-0000002"
TENANTS = [
    {"name": "alpha", "tier": "vip", "api_keys": [ALPHA_KEY]},
    # one request, then 429 rate_limited for a hundred seconds
    {"name": "beta", "tier": "normal", "api_keys": [BETA_KEY], "requests_per_s": 0.01},
]
PROMPT = "the-secret-prompt-text-nobody-may-trace"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"  # the client's own trace and span ids
CLIENT_SPAN = "00f067aa0ba902b7"
SERVER, CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind
# Each test on both paths: the native front's (the default) and Python's (the app alone).
PATHS = on_each_path()


def _body(stream: bool, **fake: Any) -> dict[str, Any]:
    return {
        "model": "fake-model",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 8,
        "stream": stream,
        "fake": fake,
    }


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key is not None else {}


async def _stream(
    client: httpx.AsyncClient, key: str | None, headers: dict[str, str] | None = None, **fake: Any
) -> tuple[str, str]:
    """A streamed chat request: (its X-Request-Id, the SSE text the client read)."""
    async with client.stream(
        "POST",
        "/v1/chat/completions",
        json=_body(True, **fake),
        headers={**_auth(key), **(headers or {})},
    ) as reply:
        assert reply.status_code == 200
        return reply.headers["x-request-id"], (await reply.aread()).decode()


def _root(rx: OtlpReceiver, request_id: str) -> ExportedSpan:
    roots = [s for s in rx.named("llmflow.request") if s.attributes.get("llmflow.request_id")
             == request_id]
    assert len(roots) == 1, (request_id, rx.spans)
    return roots[0]


def _upstream_of(rx: OtlpReceiver, root: ExportedSpan) -> ExportedSpan:
    ups = [s for s in rx.children(root) if s.name == "llmflow.upstream"]
    assert len(ups) == 1, rx.children(root)
    assert ups[0].kind == CLIENT
    return ups[0]


def _traceparent_sent(h: Harness, request_id: str) -> list[str]:
    """The `traceparent` vLLM received with the request (split: version, trace, parent, flags)."""
    sent = [hd for hd in h.fake.headers if hd.get("x-request-id") == request_id]
    assert len(sent) == 1, request_id
    return sent[0]["traceparent"].split("-")


@PATHS
async def test_spans_and_the_traceparent_vllm_received(native: bool) -> None:
    with OtlpReceiver() as rx:
        async with start_gateway(
            tenants=TENANTS,
            timeouts={"total_ms": 1000},
            native=native,
            telemetry={"otlp_endpoint": rx.url, "service_name": "gw-under-test"},
        ) as h:
            c = h.client
            streamed, text = await _stream(c, ALPHA_KEY)
            assert "data: [DONE]" in text
            reply = await c.post(
                "/v1/chat/completions", json=_body(False), headers=_auth(ALPHA_KEY)
            )
            assert reply.status_code == 200
            unstreamed = reply.headers["x-request-id"]
            first = await c.post("/v1/chat/completions", json=_body(False), headers=_auth(BETA_KEY))
            assert first.status_code == 200
            refused = await c.post(
                "/v1/chat/completions", json=_body(False), headers=_auth(BETA_KEY)
            )
            assert refused.status_code == 429
            # 20 tokens 0.25 s apart: the 1 s deadline cuts it with a notice
            cut, text = await _stream(c, ALPHA_KEY, tokens=20, itl=0.25)
            assert '"truncated":true' in text.replace(" ", "")
            seen = h.fake.seen
        # the gateway has stopped: its last spans are flushed
    assert seen == 4  # the refusal never reached vLLM
    served_by(native, streamed, unstreamed, refused.headers["x-request-id"], cut)

    for request_id in (streamed, unstreamed):
        root = _root(rx, request_id)
        assert (root.kind, root.service) == (SERVER, "gw-under-test")
        a = root.attributes
        assert (a["llmflow.tenant"], a["llmflow.tier"], a["llmflow.backend"]) == (
            "alpha", "vip", "b0"
        )
        assert (a["llmflow.outcome"], a["llmflow.reason"]) == ("completed", "completed")
        assert a["llmflow.queued_s"] >= 0
        assert a["http.response.status_code"] == 200
        assert a["llmflow.output_tokens"] == 8
        upstream = _upstream_of(rx, root)
        version, trace_id, parent, flags = _traceparent_sent(h, request_id)
        assert (version, trace_id, parent) == ("00", root.trace_id, upstream.span_id)
        assert int(flags, 16) & 1  # sampled
        assert root.start_ns <= upstream.start_ns <= upstream.end_ns <= root.end_ns

    root = _root(rx, refused.headers["x-request-id"])
    a = root.attributes
    assert (a["llmflow.tenant"], a["llmflow.tier"], a["llmflow.reason"]) == (
        "beta", "normal", "rate_limited"
    )
    assert a["llmflow.retry_after_s"] == int(refused.headers["retry-after"])
    assert (a["http.response.status_code"], a["llmflow.outcome"]) == (429, "rejected")
    assert rx.children(root) == []  # never queued, never sent upstream

    root = _root(rx, cut)
    a = root.attributes
    assert (a["llmflow.reason"], a["llmflow.truncated"], a["llmflow.outcome"]) == (
        "deadline", "deadline", "truncated"
    )
    assert 0 < a["llmflow.output_tokens"] < 20
    upstream = _upstream_of(rx, root)
    assert _traceparent_sent(h, cut)[1:3] == [root.trace_id, upstream.span_id]
    # About the 1 s deadline, from the span's own timestamps (loose: a loaded machine).
    assert 0.9e9 < root.end_ns - root.start_ns < 5e9

    # Nothing of the prompt, and no API key, anywhere in what was exported.
    exported = b"".join(rx.bodies)
    for secret in (PROMPT, ALPHA_KEY, BETA_KEY, "Bearer"):
        assert secret.encode() not in exported


@PATHS
async def test_a_client_traceparent_is_continued(native: bool) -> None:
    incoming = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    with OtlpReceiver() as rx:
        async with start_gateway(
            telemetry={"otlp_endpoint": rx.url + "/v1/traces"}, native=native
        ) as h:
            streamed, _ = await _stream(h.client, None, {"traceparent": incoming})
            reply = await h.client.post(
                "/v1/chat/completions", json=_body(False), headers={"traceparent": incoming}
            )
            assert reply.status_code == 200
    served_by(native, streamed, reply.headers["x-request-id"])
    for request_id in (streamed, reply.headers["x-request-id"]):
        root = _root(rx, request_id)
        assert (root.trace_id, root.parent_span_id) == (CLIENT_TRACE, CLIENT_SPAN)
        upstream = _upstream_of(rx, root)
        assert _traceparent_sent(h, request_id)[1:3] == [CLIENT_TRACE, upstream.span_id]


@PATHS
async def test_a_request_refused_from_the_queue_has_a_queue_span(native: bool) -> None:
    with OtlpReceiver() as rx:
        async with start_gateway(
            gate={"max_concurrency_per_gpu": 1, "queue": {"max_wait_ms": 200}},
            streaming={"first_token_timeout_ms": None},
            telemetry={"otlp_endpoint": rx.url},
            native=native,
        ) as h:
            async with h.client.stream(
                "POST", "/v1/chat/completions", json=_body(True, tokens=3, itl=0.4)
            ) as held:
                assert held.status_code == 200
                waited = await h.client.post("/v1/chat/completions", json=_body(False))
                await held.aread()
            assert waited.status_code == 503
    served_by(native, waited.headers["x-request-id"])
    root = _root(rx, waited.headers["x-request-id"])
    assert root.attributes["llmflow.reason"] == "queue_timeout"
    assert root.attributes["llmflow.outcome"] == "timed_out"  # the access log's word
    queue = [s for s in rx.children(root) if s.name == "llmflow.queue"]
    assert len(queue) == 1
    assert 0.15e9 < queue[0].end_ns - queue[0].start_ns < 5e9
    assert not [s for s in rx.children(root) if s.name == "llmflow.upstream"]


@PATHS
async def test_sampled_out_traces_export_nothing_and_say_so_upstream(native: bool) -> None:
    with OtlpReceiver() as rx:
        async with start_gateway(
            telemetry={"otlp_endpoint": rx.url, "sample_ratio": 0.0}, native=native
        ) as h:
            reply = await h.client.post("/v1/chat/completions", json=_body(False))
            assert reply.status_code == 200
    served_by(native, reply.headers["x-request-id"])
    assert rx.spans == []
    flags = _traceparent_sent(h, reply.headers["x-request-id"])[3]
    assert not int(flags, 16) & 1  # vLLM is told the trace is not sampled: it records none


async def test_off_by_default_sends_no_traceparent(gw: Harness) -> None:
    reply = await gw.client.post("/v1/chat/completions", json=_body(False))
    assert reply.status_code == 200
    assert "traceparent" not in gw.fake.headers[0]
    assert json.loads(reply.text)["choices"][0]["message"]["content"]


def _continuing(incoming: str, ratio: float) -> str:
    """The flags the SDK gives a span continuing `incoming` (the Python path's, by definition:
    the sampled bit as the parent's, the random-trace-id bit kept since SDK 1.43)."""
    tracer = TracerProvider(sampler=ParentBased(TraceIdRatioBased(ratio))).get_tracer("t")
    parent = TraceContextTextMapPropagator().extract({"traceparent": incoming})
    return f"{tracer.start_span('x', context=parent).get_span_context().trace_flags:02x}"


@PATHS
async def test_the_parents_flag_decides_the_sampling(native: bool) -> None:
    """A client's trace is sampled as its flag says, whatever the ratio would say of its id;
    vLLM gets the client's trace with the flags the SDK gives a span continuing it."""
    low = 0x1234  # low 64 bits below the ratio's bound: the ratio alone would sample it
    high = 0xF << 60  # above it: the ratio alone would not
    chosen = {  # the client's flags -> (its trace id, exported)
        "01": (f"{7:016x}{high:016x}", True),
        "03": (f"{8:016x}{high:016x}", True),
        "ff": (f"{10:016x}{high:016x}", True),
        "00": (f"{9:016x}{low:016x}", False),
        "02": (f"{11:016x}{low:016x}", False),
    }
    sent = {}
    with OtlpReceiver() as rx:
        async with start_gateway(
            telemetry={"otlp_endpoint": rx.url, "sample_ratio": 0.5}, native=native
        ) as h:
            for flags, (trace_id, _) in chosen.items():
                incoming = f"00-{trace_id}-{CLIENT_SPAN}-{flags}"
                sent[flags], _ = await _stream(h.client, None, {"traceparent": incoming})
    served_by(native, *sent.values())
    for flags, (trace_id, exported) in chosen.items():
        version, sent_trace, parent, sent_flags = _traceparent_sent(h, sent[flags])
        expected = _continuing(f"00-{trace_id}-{CLIENT_SPAN}-{flags}", 0.5)
        assert (version, sent_trace, sent_flags) == ("00", trace_id, expected)
        assert bool(int(sent_flags, 16) & 1) == exported
        roots = [s for s in rx.named("llmflow.request") if s.trace_id == trace_id]
        assert len(roots) == int(exported), flags
        if exported:
            assert roots[0].parent_span_id == CLIENT_SPAN
            assert parent == _upstream_of(rx, roots[0]).span_id
    assert {s.trace_id for s in rx.spans} == {chosen[f][0] for f in ("01", "03", "ff")}


@PATHS
async def test_new_traces_are_sampled_by_their_id(native: bool) -> None:
    """At a ratio of 0.5 each new trace is sampled as the SDK's `TraceIdRatioBased` samples its
    id (read from what vLLM received), and exported exactly when sampled."""
    with OtlpReceiver() as rx:
        async with start_gateway(
            telemetry={"otlp_endpoint": rx.url, "sample_ratio": 0.5}, native=native
        ) as h:
            request_ids = []
            for _ in range(24):
                reply = await h.client.post("/v1/chat/completions", json=_body(False))
                assert reply.status_code == 200
                request_ids.append(reply.headers["x-request-id"])
    served_by(native, *request_ids)
    sampler = TraceIdRatioBased(0.5)
    new_trace_flags = {_continuing("", 0.0), _continuing("", 1.0)}  # the SDK's, unsampled or not
    for request_id in request_ids:
        _, trace_id, parent, flags = _traceparent_sent(h, request_id)
        decision = sampler.should_sample(None, int(trace_id, 16), "llmflow.request").decision
        sampled = decision is Decision.RECORD_AND_SAMPLE
        assert bool(int(flags, 16) & 1) == sampled, trace_id
        assert flags in new_trace_flags
        roots = [s for s in rx.named("llmflow.request") if s.trace_id == trace_id]
        assert len(roots) == int(sampled)
        if sampled:
            assert roots[0].attributes["llmflow.request_id"] == request_id
            assert parent == _upstream_of(rx, roots[0]).span_id
    assert len({_traceparent_sent(h, r)[1] for r in request_ids}) == len(request_ids)


def _tree(rx: OtlpReceiver, request_id: str) -> tuple[Any, ...]:
    """A request's spans as both paths must agree on them: all but ids and times."""
    root = _root(rx, request_id)
    attributes = {k: v for k, v in root.attributes.items() if k != "llmflow.request_id"}
    children = sorted(
        (s.name, s.kind, s.status_code, sorted(s.attributes.items()))
        for s in rx.children(root)
    )
    return root.kind, root.status_code, root.parent_span_id, attributes, children


async def test_both_paths_export_the_same_spans() -> None:
    """The same requests through the native front and through Python: the same spans, with
    the same attributes, kinds, statuses and children."""
    trees = {}
    for native in paths():
        with OtlpReceiver() as rx:
            async with start_gateway(
                tenants=TENANTS,
                native=native,
                telemetry={"otlp_endpoint": rx.url},
            ) as h:
                c = h.client
                ids = {"streamed": (await _stream(c, ALPHA_KEY))[0]}
                traced = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
                ids["continued"] = (await _stream(c, ALPHA_KEY, traced))[0]
                keys = (("whole", ALPHA_KEY), ("first", BETA_KEY), ("refused", BETA_KEY))
                for label, key in keys:
                    reply = await c.post(
                        "/v1/chat/completions", json=_body(False), headers=_auth(key)
                    )
                    ids[label] = reply.headers["x-request-id"]
                assert reply.status_code == 429
                failed = await c.post(
                    "/v1/chat/completions", json=_body(False, status=500), headers=_auth(ALPHA_KEY)
                )
                assert failed.status_code >= 500
                ids["failed"] = failed.headers["x-request-id"]
        served_by(native, *ids.values())
        trees[native] = {label: _tree(rx, request_id) for label, request_id in ids.items()}
    _, python = with_reference([plain(trees[n]) for n in paths()], "spans")
    assert plain(trees[True]) == python
    assert trees[True]["failed"][1] == 2  # ERROR
    assert trees[True]["continued"][2] == CLIENT_SPAN


def _extracted(header: bytes) -> tuple[int, int, int] | None:
    """What the SDK's propagator reads of a `traceparent` (as Starlette decodes it)."""
    carrier = {"traceparent": header.decode("latin-1")}
    span = get_current_span(TraceContextTextMapPropagator().extract(carrier)).get_span_context()
    return (span.trace_id, span.span_id, span.trace_flags) if span.is_valid else None


def test_the_front_reads_a_traceparent_as_the_propagator() -> None:
    """Well-formed, near-miss and mangled headers: the front continues exactly the traces the
    SDK's propagator continues, with the same ids and flags."""
    good = [
        f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
        f"cc-{CLIENT_TRACE}-{CLIENT_SPAN}-ff-and-more",
        f" \t00-{CLIENT_TRACE}-{CLIENT_SPAN}-00 \t",
    ]
    rng = random.Random(11)
    alphabet = "0123456789abcdefABCDEF-- \t\nxz\x85\xff"
    cases = [h.encode("latin-1") for h in good]
    cases += [b"", b"00", f"00-{'0' * 32}-{CLIENT_SPAN}-01".encode(), good[1].encode() + b"\n"]
    cases += [(good[1] + "x" * n).encode() for n in (455, 456, 457, 470)]  # about 512 bytes
    for _ in range(3000):
        chars = list(rng.choice(good))
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(chars) + 1)
            edit = rng.choice("rid")
            if edit == "r" and at < len(chars):
                chars[at] = rng.choice(alphabet)
            elif edit == "i":
                chars.insert(at, rng.choice(alphabet))
            elif at < len(chars):
                del chars[at]
        cases.append("".join(chars).encode("latin-1"))
    continued = 0
    for header in cases:
        expected = _extracted(header)
        assert front_traceparent(header) == expected, header
        continued += expected is not None
    assert 100 < continued < len(cases) - 100  # both kinds, many times


def test_the_fronts_ratio_rule_is_the_samplers() -> None:
    """Random ids, and ids beside each bound, at ratios from 0 to 1 (ties of Python's `round`
    among them): the front samples a new trace exactly when `TraceIdRatioBased` does."""
    rng = random.Random(5)
    ratios = [0.0, 1.0, 0.5, 0.25, 0.1, 1 / 3, 2**-65, 3 * 2**-65, 1e-30, 1 - 2**-53]
    ratios += [rng.random() for _ in range(20)]
    for ratio in ratios:
        sampler = TraceIdRatioBased(ratio)
        bound = sampler.bound
        near = [bound + d + (rng.getrandbits(64) << 64) for d in (-1, 0, 1)]
        ids = [rng.getrandbits(128) for _ in range(300)] + near
        for trace_id in (i for i in ids if 0 < i < 1 << 128):
            decision = sampler.should_sample(None, trace_id, "llmflow.request").decision
            expected = decision is Decision.RECORD_AND_SAMPLE
            assert front_trace_sampled(trace_id, ratio) == expected, (ratio, trace_id)
