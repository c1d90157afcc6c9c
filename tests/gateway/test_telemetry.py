"""OpenTelemetry traces, read from outside: what a collector receives, and what vLLM received.

A small OTLP/HTTP receiver (`otlp_receiver.py`, decoding `opentelemetry-proto`) stands in for
the collector; the fake vLLM keeps every request's headers. Each check ties the two together:
the span the gateway exported for a request, and the `traceparent` vLLM got for it, share the
trace id, and vLLM's parent is the gateway's upstream span.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest

from .harness import start_gateway
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


@pytest.mark.parametrize("relay", [True, False], ids=["relay", "python-path"])
async def test_spans_and_the_traceparent_vllm_received(relay: bool) -> None:
    with OtlpReceiver() as rx:
        async with start_gateway(
            tenants=TENANTS,
            timeouts={"total_ms": 1000},
            server={"relay": relay},
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


async def test_a_client_traceparent_is_continued() -> None:
    incoming = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    with OtlpReceiver() as rx:
        async with start_gateway(telemetry={"otlp_endpoint": rx.url + "/v1/traces"}) as h:
            streamed, _ = await _stream(h.client, None, {"traceparent": incoming})
            reply = await h.client.post(
                "/v1/chat/completions", json=_body(False), headers={"traceparent": incoming}
            )
            assert reply.status_code == 200
    for request_id in (streamed, reply.headers["x-request-id"]):
        root = _root(rx, request_id)
        assert (root.trace_id, root.parent_span_id) == (CLIENT_TRACE, CLIENT_SPAN)
        upstream = _upstream_of(rx, root)
        assert _traceparent_sent(h, request_id)[1:3] == [CLIENT_TRACE, upstream.span_id]


async def test_a_request_refused_from_the_queue_has_a_queue_span() -> None:
    with OtlpReceiver() as rx:
        async with start_gateway(
            gate={"max_concurrency_per_gpu": 1, "queue": {"max_wait_ms": 200}},
            streaming={"first_token_timeout_ms": None},
            telemetry={"otlp_endpoint": rx.url},
        ) as h:
            async with h.client.stream(
                "POST", "/v1/chat/completions", json=_body(True, tokens=3, itl=0.4)
            ) as held:
                assert held.status_code == 200
                waited = await h.client.post("/v1/chat/completions", json=_body(False))
                await held.aread()
            assert waited.status_code == 503
    root = _root(rx, waited.headers["x-request-id"])
    assert root.attributes["llmflow.reason"] == "queue_timeout"
    assert root.attributes["llmflow.outcome"] == "timed_out"  # the access log's word
    queue = [s for s in rx.children(root) if s.name == "llmflow.queue"]
    assert len(queue) == 1
    assert 0.15e9 < queue[0].end_ns - queue[0].start_ns < 5e9
    assert not [s for s in rx.children(root) if s.name == "llmflow.upstream"]


async def test_sampled_out_traces_export_nothing_and_say_so_upstream() -> None:
    with OtlpReceiver() as rx:
        async with start_gateway(
            telemetry={"otlp_endpoint": rx.url, "sample_ratio": 0.0}
        ) as h:
            reply = await h.client.post("/v1/chat/completions", json=_body(False))
            assert reply.status_code == 200
    assert rx.spans == []
    flags = _traceparent_sent(h, reply.headers["x-request-id"])[3]
    assert not int(flags, 16) & 1  # vLLM is told the trace is not sampled: it records none


async def test_off_by_default_sends_no_traceparent(gw: Harness) -> None:
    reply = await gw.client.post("/v1/chat/completions", json=_body(False))
    assert reply.status_code == 200
    assert "traceparent" not in gw.fake.headers[0]
    assert json.loads(reply.text)["choices"][0]["message"]["content"]
