"""vLLM's routes beyond completions, through the gateway to the simulated vLLM over loopback.

The Responses API is governed (the runtime starts it and hears its tokens); embeddings, rerank,
score, tokenize, detokenize and audio pass through the core's light lane under their own cap.
What is checked is what the clients receive and what the simulated backend saw.
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING

import httpx
import openai
import pytest

from llmflow.presets import model as model_preset

from .harness import SIM_MODEL as MODEL
from .harness import start_gateway, start_sim_gateway, until

if TYPE_CHECKING:
    from collections.abc import Awaitable

pytestmark = pytest.mark.anyio

HIDDEN = model_preset("llama-3-8b").hidden  # the simulated backend's model


def _client(url: str, key: str = "k") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


async def test_embeddings_through_the_openai_client_have_the_models_width() -> None:
    async with start_sim_gateway() as h, _client(h.url) as c:
        reply = await c.embeddings.create(model=MODEL, input=["hello world", "other text"])
        plain = await c.embeddings.create(model=MODEL, input="hello world", encoding_format="float")
    assert [len(d.embedding) for d in reply.data] == [HIDDEN, HIDDEN]
    assert math.isclose(sum(v * v for v in reply.data[0].embedding), 1.0, rel_tol=1e-4)
    assert plain.data[0].embedding == pytest.approx(reply.data[0].embedding, abs=1e-6)
    assert reply.data[0].embedding != reply.data[1].embedding


async def test_tokenize_counts_what_a_completion_is_charged_and_detokenize_reverses_it() -> None:
    prompt = "The gateway passes tokenize through, 你好!"
    async with start_sim_gateway() as h, _client(h.url) as c:
        tokens = (await h.client.post("/tokenize", json={"model": MODEL, "prompt": prompt})).json()
        text = await h.client.post("/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]})
        completion = await c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, extra_body={"ignore_eos": True}
        )
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == tokens["count"]
    assert text.json() == {"prompt": prompt}


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
async def test_rerank_and_its_aliases_pass_through(path: str) -> None:
    body = {"model": MODEL, "query": "fast llm gateway", "documents": ["a gateway", "cake"]}
    async with start_sim_gateway() as h:
        r = await h.client.post(path, json=body)
    assert r.status_code == 200, r.text
    assert [x["index"] for x in r.json()["results"]] == [0, 1]
    assert r.json()["results"][0]["relevance_score"] > 0


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
async def test_score_passes_through(path: str) -> None:
    body = {"model": MODEL, "text_1": "llm gateway", "text_2": ["the gateway", "cake", "llm"]}
    async with start_sim_gateway() as h:
        r = await h.client.post(path, json=body)
    assert r.status_code == 200, r.text
    assert [d["score"] for d in r.json()["data"]] == [0.5, 0.0, 0.5]


async def test_audio_transcription_passes_the_multipart_bytes_through() -> None:
    audio = bytes(range(256)) * 64  # 16 KiB: four words at the simulator's rate
    async with start_sim_gateway() as h, _client(h.url) as c:
        reply = await c.audio.transcriptions.create(model=MODEL, file=("a.wav", audio))
        r = await h.client.post(
            "/v1/audio/translations", files={"file": ("a.wav", audio)}, data={"model": "nope"}
        )
    assert len(reply.text.split()) == 4
    assert r.status_code == 404  # the backend's answer, passed through


async def test_the_body_limit_applies_to_audio() -> None:
    async with start_sim_gateway(server={"max_body_bytes": 4096}) as h:
        r = await h.client.post("/v1/audio/transcriptions", files={"file": ("a.wav", b"x" * 8000)})
    assert r.status_code == 413
    assert r.json()["error"]["type"] == "invalid_request_error"


async def test_responses_whole_and_streamed_through_the_openai_client() -> None:
    async with start_sim_gateway() as h, _client(h.url) as c:
        whole = await c.responses.create(
            model=MODEL, input="hello", max_output_tokens=7, extra_body={"ignore_eos": True}
        )
        stream = await c.responses.create(
            model=MODEL,
            input=[{"role": "user", "content": "hello"}],
            max_output_tokens=9,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        events = [e async for e in stream]
    assert whole.status == "completed"
    assert whole.usage is not None
    assert whole.usage.output_tokens == 7
    assert len(whole.output_text.split()) == 7
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 9
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == "".join(deltas)


async def test_responses_are_governed_by_the_runtime_and_a_disconnect_aborts_upstream() -> None:
    body = {
        "model": MODEL,
        "input": "hi",
        "stream": True,
        "max_output_tokens": 3000,
        "ignore_eos": True,
    }
    async with start_sim_gateway() as h:
        async with h.client.stream("POST", "/v1/responses", json=body) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            seen = 0
            async for line in lines:
                seen += line.startswith("event: response.output_text.delta")
                if seen == 3:
                    break
            assert h.gateway.runtime.running == 1  # the runtime holds its slot
        engine = h.sim.state.sim["engine"]
        await until(lambda: h.gateway.runtime.running == 0)
        await until(lambda: not engine.core.running and not engine.core.waiting)


async def test_responses_bad_input_is_an_openai_error_before_any_backend() -> None:
    async with start_sim_gateway() as h:
        cases = {
            b"{": 400,
            b'{"model": "fake-model"}': 400,
            b'{"model": "nope", "input": "x"}': 404,
            b'{"model": "fake-model", "input": "x", "max_output_tokens": 100000}': 400,
        }
        for raw, status in cases.items():
            r = await h.client.post(
                "/v1/responses", content=raw, headers={"content-type": "application/json"}
            )
            assert r.status_code == status, (raw, r.text)
            assert set(r.json()["error"]) >= {"message", "type", "code"}
        engine = h.sim.state.sim["engine"]
        assert engine.core.running == [] or not engine.core.running


async def test_light_routes_bad_input_and_unknown_model() -> None:
    async with start_sim_gateway() as h:
        bad = await h.client.post(
            "/v1/embeddings", content=b"[1]", headers={"content-type": "application/json"}
        )
        unknown = await h.client.post("/v1/embeddings", json={"model": "nope", "input": "x"})
        backend = await h.client.post("/v1/embeddings", json={"model": MODEL, "input": []})
    assert bad.status_code == 400
    assert bad.json()["error"]["code"] == "invalid_json"
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"
    assert backend.status_code == 400  # the backend's own 400, passed through
    assert "input must be" in backend.json()["error"]["message"]


async def test_every_route_needs_a_good_api_key_when_keys_are_configured() -> None:
    tenants = [{"name": "acme", "tier": "vip", "api_keys": ["good-key"]}]
    paths = [
        "/v1/embeddings",
        "/v1/responses",
        "/v1/rerank",
        "/v1/score",
        "/tokenize",
        "/detokenize",
        "/v1/audio/transcriptions",
        "/score",
        "/rerank",
        "/v2/rerank",
    ]
    async with start_sim_gateway(tenants=tenants) as h:
        for path in paths:
            r = await h.client.post(path, json={"model": MODEL, "prompt": "x"})
            assert r.status_code == 401, path
            assert r.json()["error"]["type"] == "authentication_error"
        good = await h.client.post(
            "/tokenize",
            json={"model": MODEL, "prompt": "abcd"},
            headers={"authorization": "Bearer good-key"},
        )
    assert good.json()["count"] == 1
    assert h.sim.state.sim["light_peak"] == 1  # the refused ones never reached the backend


async def test_the_light_cap_holds_at_the_backend_and_refusals_carry_retry_after() -> None:
    async with start_sim_gateway(
        sim_options={"light_hold_s": 0.4}, backend={"light_concurrency": 2}
    ) as h:
        body = {"model": MODEL, "input": "x"}
        replies = await asyncio.gather(
            *(h.client.post("/v1/embeddings", json=body) for _ in range(6))
        )
        after = await h.client.post("/v1/embeddings", json=body)
    statuses = sorted(r.status_code for r in replies)
    assert statuses == [200, 200, 429, 429, 429, 429]
    assert h.sim.state.sim["light_peak"] == 2  # the backend never held more than the cap
    for r in replies:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "light_lane_full"
    assert after.status_code == 200  # every slot came back


async def test_a_lower_tier_is_shed_first_on_the_light_lane() -> None:
    # Four light slots; batch (shed_at 0.5) is let in while fewer than two are taken, so a
    # batch flood leaves the other two to vip, counted at the simulated vLLM's own door.
    tenants = [
        {"name": "bulk", "tier": "batch", "api_keys": ["k-bulk-tenant-0001"]},
        {"name": "acme", "tier": "vip", "api_keys": ["k-acme-tenant-0001"]},
    ]
    async with start_sim_gateway(
        tenants=tenants, sim_options={"light_hold_s": 0.8}, backend={"light_concurrency": 4}
    ) as h:
        body = {"model": MODEL, "input": "x"}

        def embed(key: str) -> Awaitable[httpx.Response]:
            headers = {"authorization": f"Bearer {key}"}
            return h.client.post("/v1/embeddings", json=body, headers=headers)

        flood = asyncio.gather(*(embed("k-bulk-tenant-0001") for _ in range(6)))
        await until(lambda: h.sim.state.sim["light"] == 2)
        vip = await asyncio.gather(*(embed("k-acme-tenant-0001") for _ in range(2)))
        bulk = await flood
    assert sorted(r.status_code for r in bulk) == [200, 200, 429, 429, 429, 429]
    for r in bulk:
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "tier_shed"
            assert int(r.headers["retry-after"]) >= 1
    assert [r.status_code for r in vip] == [200, 200]
    assert h.sim.state.sim["light_peak"] == 4  # two of batch's, two of vip's, never more


async def test_a_client_leaving_a_light_request_frees_its_slot() -> None:
    async with start_sim_gateway(
        sim_options={"light_hold_s": 1.5}, backend={"light_concurrency": 1}
    ) as h:
        body = {"model": MODEL, "input": "x"}
        async with httpx.AsyncClient(base_url=h.url, timeout=0.3) as impatient:
            with pytest.raises(httpx.ReadTimeout):
                await impatient.post("/v1/embeddings", json=body)
        await asyncio.sleep(0.1)
        # The backend still works on the abandoned request; the gateway's slot is free again.
        assert h.sim.state.sim["light"] == 1
        r = await h.client.post("/tokenize", json={"model": MODEL, "prompt": "abcd"})
    assert r.status_code == 200


async def test_a_browned_out_response_is_clamped_upstream_in_max_output_tokens() -> None:
    """One slot, brownout from one waiting place in four: the third response is sent upstream
    with `max_output_tokens` 7, and the simulated vLLM generates 7 tokens for it."""
    tiers = [
        {"name": "vip", "protected": True},
        {"name": "normal", "shed_at": 1.0, "brownout_at": 0.25, "brownout_max_tokens": 7},
    ]
    async with start_sim_gateway(
        tiers=tiers,
        default_tier="normal",
        gate={"max_concurrency_per_gpu": 1, "queue": {"max_waiting": 4}},
    ) as h:
        rt = h.gateway.runtime

        def ask(tokens: int) -> asyncio.Task[httpx.Response]:
            body = {"model": MODEL, "input": "hi", "max_output_tokens": tokens, "ignore_eos": True}
            return asyncio.create_task(h.client.post("/v1/responses", json=body, timeout=30))

        tasks = [ask(1500)]
        await until(lambda: rt.running == 1)
        tasks.append(ask(50))
        await until(lambda: rt.queued == 1)
        tasks.append(ask(50))
        await until(lambda: rt.queued == 2)
        replies = await asyncio.gather(*tasks)
    assert [r.status_code for r in replies] == [200] * 3
    assert [r.json()["usage"]["output_tokens"] for r in replies] == [1500, 50, 7]


async def test_a_route_the_backend_lacks_is_its_404_in_openais_shape() -> None:
    """vLLM registers the pooling routes only for pooling models; the fake has none at all."""
    async with start_gateway() as h:
        r = await h.client.post("/v1/embeddings", json={"model": "fake-model", "input": "x"})
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "backend_rejected"
    assert error["message"].startswith("the backend answered 404 for /v1/embeddings")
