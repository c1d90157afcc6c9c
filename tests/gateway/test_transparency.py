"""What vLLM accepts the gateway accepts, and what vLLM answers the client gets (docs/gateway.md,
"Transparency"), against the fake vLLM: its received bodies and counts are the instrument.

The real-vLLM comparison is `tests/integration/test_differential_vllm.py`; these pin each rule
where it is cheap to: vLLM's refusal inside a stream before the first token is its 4xx (on the
relay and on the Python path), nullable fields, `stream_options` without `stream`, a batch of
prompts served and planned for as a whole, and a whole reply in vLLM's unstreamed shape.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from .harness import Harness, start_gateway

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
REFUSED = {"error_after": 0, "error_param": "logprobs"}  # vLLM's in-band 400, before a token


def _completion(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": "hi", "max_tokens": 3, **extra}


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.mark.parametrize(
    "body",
    [
        _completion(stream=True, fake=REFUSED),  # relayed (one choice)
        _completion(stream=True, n=2, fake=REFUSED),  # the Python path (two choices)
        _completion(fake=REFUSED),  # a whole reply
        _chat(stream=True, fake=REFUSED),
    ],
    ids=["relay", "python-stream", "whole", "chat"],
)
async def test_vllms_in_band_refusal_before_a_token_is_its_400(
    gw: Harness, body: dict[str, Any]
) -> None:
    path = CHAT if "messages" in body else COMPLETIONS
    r = await gw.client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"] == {
        "message": "logprobs is over the maximum (parameter=logprobs)",
        "type": "BadRequestError",
        "param": "logprobs",
        "code": 400,
    }
    assert gw.fake.seen == 1


async def test_an_in_band_engine_failure_is_still_a_502(gw: Harness) -> None:
    r = await gw.client.post(COMPLETIONS, json=_completion(stream=True, fake={"error_after": 0}))
    assert r.status_code == 502, r.text
    assert "EngineCore" in r.json()["error"]["message"]


async def test_nullable_fields_are_vllms_defaults(gw: Harness) -> None:
    r = await gw.client.post(
        COMPLETIONS, json=_completion(stream=None, echo=None, stream_options=None)
    )
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "text_completion"  # `"stream": null` is a whole reply
    r = await gw.client.post(CHAT, json=_chat(n=None, stream=None, max_tokens=2))
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1


async def test_stream_options_without_stream_is_vllms_400(gw: Harness) -> None:
    for path, body in ((COMPLETIONS, _completion()), (CHAT, _chat())):
        r = await gw.client.post(path, json={**body, "stream_options": {"include_usage": True}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "stream_options"
        assert "only be defined when `stream=True`" in r.json()["error"]["message"]
    assert gw.fake.seen == 0
    # empty options are no options, for vLLM too
    r = await gw.client.post(COMPLETIONS, json=_completion(stream=False, stream_options={}))
    assert r.status_code == 200, r.text


async def test_max_tokens_zero_is_for_echo_alone(gw: Harness) -> None:
    r = await gw.client.post(COMPLETIONS, json=_completion(max_tokens=0))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "max_tokens"
    assert gw.fake.seen == 0
    r = await gw.client.post(COMPLETIONS, json=_completion(max_tokens=0, echo=True))
    assert r.status_code == 200, r.text


async def test_a_whole_reply_has_every_field_of_vllms_unstreamed_form(gw: Harness) -> None:
    r = await gw.client.post(COMPLETIONS, json=_completion())
    body = r.json()
    assert list(body) == [
        "id", "object", "created", "model", "choices", "service_tier", "system_fingerprint",
        "usage", "kv_transfer_params", "ec_transfer_params", "metrics",
    ]  # fmt: skip
    assert list(body["choices"][0]) == [
        "index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids",
        "prompt_logprobs", "prompt_token_ids", "routed_experts",
    ]  # fmt: skip
    assert body["choices"][0]["text"] == "t0 t1 t2 "
    assert body["usage"]["completion_tokens"] == 3


async def test_a_batch_is_served_and_planned_as_every_prompt_and_choice() -> None:
    batch = _completion(prompt=[[7] * 40, [8] * 24], n=2, max_tokens=8, fake={"step": True})
    single = _completion(prompt=[9] * 64, n=4, max_tokens=8, fake={"step": True})
    first = _completion(prompt=[7] * 40, n=2, max_tokens=8, fake={"step": True})
    planned = []
    for body in (batch, single, first):
        async with start_gateway() as h:  # a fresh core each: no expected output learnt yet
            task = asyncio.create_task(h.client.post(COMPLETIONS, json=body))
            core = (await _held(h))["core"]
            planned.append((core["requests"][0]["prompt_tokens"], _committed(core)))
            h.fake.release(8)
            r = await task
            assert r.status_code == 200, r.text
            assert h.fake.bodies[0]["prompt"] == body["prompt"]  # upstream as the client sent it
            if body is batch:
                assert len(r.json()["choices"]) == 4  # n per prompt, indexed prompt by prompt
    # the batch's two prompts and 2 x 2 choices: as one 64-token prompt with n = 4, more than
    # its first prompt alone
    assert planned[0] == planned[1] == (64, 6)
    assert planned[2] == (40, 4)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_batch_cut_by_its_deadline_ends_every_choice_with_the_notice(stream: bool) -> None:
    async with start_gateway(timeouts={"total_ms": 300}) as h:
        body = _completion(prompt=["a", "b"], n=2, max_tokens=8, stream=stream, fake={"step": True})
        task = asyncio.create_task(h.client.post(COMPLETIONS, json=body))
        await _held(h)
        h.fake.release(2)  # two tokens of choice 0, then nothing until the deadline
        r = await task
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line[6:7] == "{"]
            tail = events[-1]
            assert sorted(c["index"] for c in tail["choices"]) == [0, 1, 2, 3]  # all unfinished
        else:
            tail = r.json()
            choices = tail["choices"]
            assert [c["index"] for c in choices] == [0, 1, 2, 3]
            assert choices[0]["text"].startswith("t0 t1 ")  # the partial text is kept
        assert tail["llmflow"] == {"truncated": True, "reason": "deadline"}
        assert all(c["finish_reason"] == "length" for c in tail["choices"])
        assert h.fake.aborted == 1  # upstream closed, the KV freed


async def test_a_batch_counts_every_choice_against_max_n() -> None:
    async with start_gateway(limits={"max_n": 4}) as h:
        r = await h.client.post(COMPLETIONS, json=_completion(prompt=["a", "b", "c"], n=2))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["code"], error["param"]) == ("n_too_large", "n")
        assert "3 prompts x n 2 make 6 choices" in error["message"]
        r = await h.client.post(COMPLETIONS, json=_completion(prompt=["a", "b"], n=2))
        assert r.status_code == 200, r.text
        assert h.fake.seen == 1


async def _held(h: Harness) -> dict[str, Any]:
    for _ in range(500):
        state = (await h.client.get("/api/state")).json()
        if state["core"]["requests"] and h.fake.running:
            return dict(state)
        await asyncio.sleep(0.01)
    raise AssertionError(json.dumps(state)[:2000])


def _committed(core: dict[str, Any]) -> int:
    return sum(int(b["kv_blocks_committed"]) for b in core["backends"])


@pytest.mark.parametrize("asks", [{"prompt_logprobs": 1}, {"echo": True, "logprobs": 2}])
async def test_prompt_logprobs_go_upstream_unstreamed_and_come_back_whole(
    gw: Harness, asks: dict[str, Any]
) -> None:
    # vLLM computes them only for a reply it does not stream: its answer is the client's
    r = await gw.client.post(COMPLETIONS, json=_completion(max_tokens=4, **asks))
    assert r.status_code == 200, r.text
    assert r.json()["fake_whole"] is True  # vLLM's answer as it wrote it
    assert r.json()["choices"][0]["prompt_logprobs"] == [None, {"7": -1.5}]
    sent = gw.fake.bodies[0]
    assert "stream" not in sent
    assert "stream_options" not in sent
    assert gw.fake.completed == 1
