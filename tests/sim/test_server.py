"""The simulated vLLM server: OpenAI surface, streaming, disconnect abort, vLLM metrics."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

import httpx
import pytest
from fastapi.testclient import TestClient
from inline_snapshot import snapshot

from llmflow.sim.server import create_app, estimate_tokens, parse_preset
from tests.gateway.harness import serve_asgi

if TYPE_CHECKING:
    from collections.abc import Iterator


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(speed=50.0, models=["sim"])) as c:
        yield c


def test_models_and_health(client: TestClient) -> None:
    assert client.get("/health").status_code == 200
    assert client.get("/v1/models").json() == snapshot({
        "object": "list",
        "data": [{"id": "sim", "object": "model", "created": 0, "owned_by": "vllm",
                  "root": "sim", "parent": None, "max_model_len": 8192}],
    })


def test_completion_with_ignore_eos_returns_max_tokens(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": "sim", "prompt": "abcd" * 25,
                                              "max_tokens": 12, "ignore_eos": True})
    body = r.json()
    assert r.status_code == 200
    assert body["usage"] == {"prompt_tokens": 25, "completion_tokens": 12, "total_tokens": 37}
    assert body["choices"][0]["finish_reason"] == "length"


def test_chat_stream_is_sse_ending_with_done(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}})
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"])
    assert len(text.split()) == 5


def test_errors_look_like_vllm(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404
    assert r.json() == snapshot({"error": {"message": "The model `nope` does not exist.",
                                           "type": "NotFoundError", "param": None,
                                           "code": 404}})
    r = client.post("/v1/completions", json={"prompt": "x" * 40_000, "max_tokens": 10})
    assert r.status_code == 400
    assert "maximum context length is 8192 tokens" in r.json()["error"]["message"]


def test_metrics_use_vllm_names(client: TestClient) -> None:
    client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "ignore_eos": True})
    text = client.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
                 "vllm:cache_config_info", "vllm:generation_tokens_total",
                 "vllm:prompt_tokens_total", "vllm:time_to_first_token_seconds_bucket"):
        assert name in text
    assert 'vllm:generation_tokens_total{engine="0",model_name="sim"} 3.0' in text
    assert 'num_gpu_blocks="' in text


def test_disconnect_aborts_a_stream() -> None:
    app = create_app(speed=1.0)
    with TestClient(app) as c:
        with c.stream("POST", "/v1/completions", json={
                "prompt": "x", "max_tokens": 5000, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break  # closing the response disconnects
        engine = app.state.sim["engine"]
        for _ in range(200):
            if engine.core.num_running == 0:
                break
            c.get("/health")
        assert engine.core.num_running == 0
        assert engine.core.used == 0


def test_token_estimate_and_preset() -> None:
    assert estimate_tokens("abcdefgh") == 2
    assert estimate_tokens("你好") == 2
    assert parse_preset("h100:llama-3-70b:4") == ("h100", "llama-3-70b", 4)
    with pytest.raises(ValueError, match="GPU:MODEL"):
        parse_preset("h100")


@pytest.fixture
def anyio_backend() -> str:
    """Async tests run on asyncio (the server's loop)."""
    return "asyncio"


@pytest.mark.anyio
async def test_closing_an_unstreamed_request_aborts_it_in_the_engine() -> None:
    # a real socket: the client gives up after 0.3 s; the server notices within ~0.1 s and
    # frees the request's slot and KV blocks, as vLLM does
    app = create_app(speed=1.0)
    async with serve_asgi(app, http="auto") as (url, _):  # uvicorn's own HTTP, as vLLM runs
        async with httpx.AsyncClient(base_url=url, timeout=0.3) as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 5000,
                                                     "ignore_eos": True})
        engine = app.state.sim["engine"]
        for _ in range(100):
            if engine.core.num_running == 0:
                break
            await asyncio.sleep(0.02)
        assert engine.core.num_running == 0
        assert engine.core.used == 0
        assert engine.requests_success.get("length", 0) == 0  # it did not run to its end


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))


def test_a_resent_history_hits_the_prefix_cache(client: TestClient) -> None:
    # A chat's second turn resends the first: its leading blocks are found cached, as in
    # vLLM (whose counters, in prompt tokens, the server exports); an unrelated prompt is not.
    history = [{"role": "system", "content": "You are terse. " * 40},
               {"role": "user", "content": "Summarise the ledger. " * 20}]
    first = {"messages": history, "max_tokens": 4, "ignore_eos": True}
    assert client.post("/v1/chat/completions", json=first).status_code == 200
    text = client.get("/metrics").text
    queried, hits = (_metric(text, "vllm:prefix_cache_queries_total"),
                     _metric(text, "vllm:prefix_cache_hits_total"))
    assert queried > 0
    assert hits == 0
    second = {**first, "messages": [*history, {"role": "assistant", "content": "ok"},
                                     {"role": "user", "content": "And the totals?"}]}
    assert client.post("/v1/chat/completions", json=second).status_code == 200
    text = client.get("/metrics").text
    hits = _metric(text, "vllm:prefix_cache_hits_total")
    assert hits >= 16 * 10, hits  # most of the ~260-token history
    other = {"messages": [{"role": "user", "content": "Unrelated words here. " * 60}],
             "max_tokens": 4, "ignore_eos": True}
    assert client.post("/v1/chat/completions", json=other).status_code == 200
    assert _metric(client.get("/metrics").text, "vllm:prefix_cache_hits_total") == hits
