"""OpenTelemetry across the gateway and real vLLM: vLLM's own spans are children of ours.

A real `llmflow serve` (its own process) with `telemetry` pointed at a small OTLP/HTTP receiver
in this test (`tests/gateway/otlp_receiver.py`), in front of a real vLLM (CPU, tiny model)
started with `--otlp-traces-endpoint` at the same receiver over OTLP/HTTP. vLLM continues a
request's `traceparent` when it traces: its `llm_request` span must be in the gateway's trace,
with the gateway's upstream span as its parent, for a stream and for an unstreamed reply, both
served by the native front (which sends the `traceparent` itself).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.gateway.otlp_receiver import OtlpReceiver
from tests.integration.gateway_server import gateway_config
from tests.integration.gwtools import GatewayPool
from tests.integration.vllm_server import VllmServer
from tests.processes import free_port

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from tests.gateway.otlp_receiver import ExportedSpan

pytestmark = pytest.mark.integration

VLLM_EXPORT_WAIT_S = 30.0  # vLLM's batch exporter posts every 5 s; a loaded CPU is slower


def _wait_for(predicate: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.2)


def _ask(client: httpx.Client, stream: bool) -> str:
    body: dict[str, Any] = {"model": "tiny", "prompt": "Trace me", "max_tokens": 12,
                            "stream": stream, "ignore_eos": True}
    with client.stream("POST", "/v1/completions", json=body) as reply:
        reply.read()
        assert reply.status_code == 200, reply.text
        return reply.headers["x-request-id"]


def test_vllm_spans_are_children_of_the_gateway_upstream_span(
    vllm_python: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    with OtlpReceiver() as rx:
        vllm = VllmServer(
            vllm_python, tiny_model_dir, free_port(),
            ["--otlp-traces-endpoint", rx.url + "/v1/traces"],
            log_path=tmp_path / "vllm.log",
            env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
        )
        with vllm, GatewayPool.running(tmp_path) as pool:
            gw = pool.start(gateway_config(
                vllm.url, telemetry={"otlp_endpoint": rx.url, "service_name": "llmflow-it"}))
            with httpx.Client(base_url=gw.url, timeout=120) as client:
                ids = [_ask(client, stream=True), _ask(client, stream=False)]
            pool.stop()  # the gateway's last spans are flushed as it stops

            def roots() -> dict[str, ExportedSpan]:
                return {s.attributes["llmflow.request_id"]: s
                        for s in rx.named("llmflow.request")
                        if s.attributes.get("llmflow.request_id") in ids}

            _wait_for(lambda: len(roots()) == 2, 10)
            found = roots()
            traces = {found[i].trace_id for i in ids}
            _wait_for(
                lambda: traces <= {s.trace_id for s in rx.spans if s.service != "llmflow-it"},
                VLLM_EXPORT_WAIT_S,
            )
    for request_id in ids:
        root = found[request_id]
        assert root.attributes["llmflow.outcome"] == "completed"
        upstream = [s for s in rx.children(root) if s.name == "llmflow.upstream"]
        assert len(upstream) == 1
        theirs = [s for s in rx.spans if s.trace_id == root.trace_id and s.service != root.service]
        assert theirs, f"vLLM exported no span in trace {root.trace_id}"
        assert {s.parent_span_id for s in theirs} == {upstream[0].span_id}, theirs
