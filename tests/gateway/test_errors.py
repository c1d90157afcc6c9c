"""Every refusal is an OpenAI-style error with the right status, checked before any backend."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import TYPE_CHECKING

import pytest

from llmflow._core import Reply
from llmflow.gateway.host import now_us

from .harness import Harness, start_gateway, until

if TYPE_CHECKING:
    import httpx

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"


def _chat(content: str = "hi", **extra: object) -> dict[str, object]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": content}], **extra}


def _error(response: httpx.Response, status: int, code: str) -> dict[str, object]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert error["code"] == code
    return error  # type: ignore[no-any-return]


async def test_malformed_json_is_400_and_never_reaches_a_backend(gw: Harness) -> None:
    r = await gw.client.post(
        CHAT,
        content=b'{"model": "fake-model", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert _error(r, 400, "invalid_json")["type"] == "invalid_request_error"
    assert gw.fake.seen == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", "10"),
        ("stream", "yes"),
        ("messages", "hi"),
        ("temperature", "hot"),
        ("n", 0),
        ("model", 7),
    ],
)
async def test_wrong_types_are_400_naming_the_field(gw: Harness, field: str, value: object) -> None:
    r = await gw.client.post(CHAT, json=_chat(**{field: value}))
    error = _error(r, 400, "invalid_request")
    assert str(error["param"]).startswith(field)
    assert gw.fake.seen == 0


async def test_prompt_longer_than_the_context_is_400_before_the_backend(gw: Harness) -> None:
    r = await gw.client.post(CHAT, json=_chat("x" * 20_000))  # ~5,000 tokens > 4,096
    assert "maximum context length is 4096" in str(
        _error(r, 400, "context_length_exceeded")["message"]
    )
    r = await gw.client.post(CHAT, json=_chat("x", max_tokens=5000))  # over the context alone
    assert _error(r, 400, "context_length_exceeded")["param"] == "max_tokens"
    r = await gw.client.post(
        "/v1/completions", json={"model": "fake-model", "prompt": list(range(5000))}
    )
    assert _error(r, 400, "context_length_exceeded")["param"] == "input_tokens"
    assert gw.fake.seen == 0
    # vLLM's rule: a max_tokens past what the prompt leaves is clamped, not refused
    r = await gw.client.post(CHAT, json=_chat("x" * 4000, max_tokens=3500))  # 1,000 + 3,500
    assert r.status_code == 200, r.text
    assert gw.fake.bodies[-1]["max_tokens"] == 3500  # vLLM clamps it


async def test_unknown_model_is_404(gw: Harness) -> None:
    r = await gw.client.post(CHAT, json={**_chat(), "model": "gpt-17"})
    assert _error(r, 404, "model_not_found")["param"] == "model"
    assert gw.fake.seen == 0


async def test_unknown_path_is_an_openai_style_404(gw: Harness) -> None:
    _error(await gw.client.get("/v1/nothing"), 404, "not_found")


async def test_body_too_large_is_413_declared_or_streamed() -> None:
    async with start_gateway(server={"max_body_bytes": 1024}) as h:
        _error(await h.client.post(CHAT, json=_chat("x" * 2000)), 413, "body_too_large")

        async def chunked():  # no Content-Length: counted as it arrives
            for _ in range(4):
                yield b" " * 512

        r = await h.client.post(
            CHAT, content=chunked(), headers={"content-type": "application/json"}
        )
        _error(r, 413, "body_too_large")
        assert h.fake.seen == 0


async def test_core_rejection_is_429_with_the_cores_retry_after() -> None:
    async with start_gateway(gate={"max_concurrency_per_gpu": 1, "queue": {"max_waiting": 0}}) as h:
        h.fake.default = {"step": True}
        first = asyncio.create_task(h.client.post(CHAT, json=_chat(max_tokens=2)))
        await until(lambda: h.fake.running != 0)
        (probe,) = copy.copy(h.gateway.runtime).arrive(10**9, "anonymous", 1, 1, True, now_us())
        r = await h.client.post(CHAT, json=_chat(max_tokens=2))
        _error(r, 429, "queue_full")
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert isinstance(probe, Reply)
        assert (probe.status, probe.reason) == (429, "queue_full")
        # the runtime's value goes on the wire as it is: one slot, no service measured yet (the
        # core's 10 s prior), one request ahead
        assert r.headers["retry-after"] == str(probe.retry_after_s) == "10"
        h.fake.release(2)
        assert (await first).status_code == 200
        assert h.fake.seen == 1


async def test_backend_500_is_502_and_frees_the_slot(gw: Harness) -> None:
    r = await gw.client.post(CHAT, json=_chat(fake={"status": 500}))
    assert "injected failure" in str(_error(r, 502, "backend_error")["message"])


async def test_backend_4xx_passes_through(gw: Harness) -> None:
    # vLLM's refusal is the client's answer: its status and its error object, as it wrote them
    r = await gw.client.post(CHAT, json=_chat(fake={"status": 400}))
    assert r.status_code == 400, r.text
    assert r.json() == {
        "error": {
            "message": "injected failure",
            "type": "server_error",
            "code": 400,
        }
    }


async def test_first_token_timeout_as_error_is_504_and_aborts_upstream() -> None:
    async with start_gateway(
        streaming={"first_token_timeout_ms": 150, "on_first_token_timeout": "error"}
    ) as h:
        r = await h.client.post(CHAT, json=_chat(fake={"hang": True}))
        _error(r, 504, "first_token_timeout")
        await h.settle()
        assert h.fake.aborted == 1


async def test_errors_are_json_the_openai_client_understands(gw: Harness) -> None:
    import openai

    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as c:
        with pytest.raises(openai.NotFoundError) as info:
            await c.chat.completions.create(
                model="nope", messages=[{"role": "user", "content": "x"}]
            )
    assert info.value.code == "model_not_found"
    assert json.loads(info.value.response.text)["error"]["type"] == "not_found_error"


async def test_a_queued_request_displaced_by_a_lighter_tenant_gets_429() -> None:
    tenants = [
        {"name": "heavy", "tier": "vip", "api_keys": ["kh"]},
        {"name": "light", "tier": "vip", "api_keys": ["kl"]},
    ]
    gate = {"max_concurrency_per_gpu": 1, "queue": {"max_waiting": 2}}
    async with start_gateway(tenants=tenants, gate=gate) as h:
        h.fake.default = {"step": True}
        heavy = {"authorization": "Bearer kh"}

        def post(headers: dict[str, str]) -> asyncio.Task[httpx.Response]:
            return asyncio.create_task(
                h.client.post(CHAT, json=_chat(max_tokens=1), headers=headers)
            )

        running = post(heavy)
        await until(lambda: h.fake.running == 1)
        first = post(heavy)
        await until(lambda: h.gateway.runtime.queued == 1)
        newest = post(heavy)
        await until(lambda: h.gateway.runtime.queued == 2)
        light = post({"authorization": "Bearer kl"})
        r = await newest
        _error(r, 429, "displaced")
        assert int(r.headers["retry-after"]) >= 1
        h.fake.release(3)
        assert [(await t).status_code for t in (running, first, light)] == [200] * 3
        # the native front counts a request as its task ends, just after the reply went out
        await until(lambda: h.gateway.metrics.outcomes["rejected", "displaced"] == 1)


async def test_stream_requests_are_400_when_streaming_is_disabled() -> None:
    async with start_gateway(streaming={"enabled": False}) as h:
        _error(await h.client.post(CHAT, json=_chat(stream=True)), 400, "streaming_disabled")
        assert (await h.client.post(CHAT, json=_chat(max_tokens=1))).status_code == 200


async def test_queue_wait_timeout_is_503_with_the_cores_retry_after() -> None:
    async with start_gateway(
        gate={"max_concurrency_per_gpu": 1, "queue": {"max_wait_ms": 200}},
        streaming={"first_token_timeout_ms": None},
    ) as h:
        h.fake.default = {"step": True}
        first = asyncio.create_task(h.client.post(CHAT, json=_chat(max_tokens=2)))
        await until(lambda: h.fake.running == 1)
        r = await h.client.post(CHAT, json=_chat(max_tokens=2))
        _error(r, 503, "queue_timeout")
        assert int(r.headers["retry-after"]) >= 1
        h.fake.release(2)
        assert (await first).status_code == 200
