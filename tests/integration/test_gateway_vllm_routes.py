"""vLLM's routes beyond completions, through the gateway to real vLLM (CPU, tiny model).

`/tokenize`, `/detokenize` and `/v1/responses` are served by the tiny generative model; the
gateway's answers are compared with vLLM's own, asked directly. For the pooling routes
(`/v1/embeddings`, `/score`, `/rerank`), whatever this vLLM build says for a generative model
(a vector, or its own error) must come back through the gateway unchanged in status and shape:
the gateway passes them through (errors in OpenAI's shape), it does not serve them. vLLM's
`/metrics` is the ground truth for tokens generated and for an abort.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest

from tests.gateway.harness import served_by
from tests.integration.gateway_server import gateway_config
from tests.integration.gwtools import gateway_idle, poll

if TYPE_CHECKING:
    from tests.integration.vllm_server import VllmServer

pytestmark = pytest.mark.integration

RUNNING, GENERATED = "vllm:num_requests_running", "vllm:generation_tokens_total"
TEXT = "The gateway passes tokenize through to vLLM."


def test_tokenize_and_detokenize_match_vllms_own(vllm: VllmServer, start_gateway: Any) -> None:
    gw = start_gateway(gateway_config(vllm.url))
    with httpx.Client(timeout=30) as c:
        direct = c.post(f"{vllm.url}/tokenize", json={"model": "tiny", "prompt": TEXT}).json()
        through = c.post(f"{gw.url}/tokenize", json={"model": "tiny", "prompt": TEXT})
        back = c.post(f"{gw.url}/detokenize", json={"model": "tiny", "tokens": direct["tokens"]})
        unknown = c.post(f"{gw.url}/tokenize", json={"model": "nope", "prompt": TEXT})
    assert through.status_code == 200, through.text
    assert through.json()["tokens"] == direct["tokens"]
    assert through.json()["count"] == len(direct["tokens"]) > 0
    assert back.status_code == 200, back.text
    assert TEXT in back.json()["prompt"]
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"


def test_responses_whole_and_streamed_count_what_vllm_generated(
    vllm: VllmServer, start_gateway: Any
) -> None:
    gw = start_gateway(gateway_config(vllm.url))
    with (
        httpx.Client(timeout=10) as m,
        openai.OpenAI(base_url=gw.openai_base_url, api_key="unused", max_retries=0) as client,
    ):
        before = vllm.metrics(m)[GENERATED]
        raw = client.responses.with_raw_response.create(
            model="tiny",
            input="Tell me about queues",
            max_output_tokens=24,
            extra_body={"ignore_eos": True},
        )
        served_by(True, raw.headers["x-request-id"])  # the native front's, not Python's
        whole = raw.parse()
        events = list(
            client.responses.create(
                model="tiny",
                input=[{"role": "user", "content": "and streams"}],
                max_output_tokens=16,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        generated = vllm.metrics(m)[GENERATED] - before
        poll(lambda: gateway_idle(gw.state(m)), 2.0)
    assert whole.usage is not None
    assert whole.usage.output_tokens == 24
    final = events[-1]
    assert final.type == "response.completed"
    assert final.response.usage is not None
    assert final.response.usage.output_tokens == 16
    deltas = [e for e in events if e.type.endswith(".delta")]
    assert 1 < len(deltas) <= 16
    assert generated == 24 + 16


def test_a_responses_stream_the_client_leaves_is_aborted_in_vllm(
    vllm: VllmServer, start_gateway: Any
) -> None:
    gw = start_gateway(gateway_config(vllm.url))
    body = {
        "model": "tiny",
        "input": "x",
        "stream": True,
        "max_output_tokens": 1900,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=10) as m:
        before = vllm.metrics(m)[GENERATED]
        with (
            httpx.Client(timeout=30) as c,
            c.stream("POST", f"{gw.url}/v1/responses", json=body) as r,
        ):
            assert r.status_code == 200
            deltas = 0
            for line in r.iter_lines():
                deltas += line.startswith("event: response.") and line.endswith(".delta")
                if deltas >= 10:
                    break
            assert vllm.metrics(m)[RUNNING] == 1
        poll(lambda: vllm.metrics(m)[RUNNING] == 0, 1.0)
        after = vllm.metrics(m)[GENERATED]
        time.sleep(0.5)
        assert vllm.metrics(m)[GENERATED] == after, "vLLM kept generating after the abort"
        assert after - before < 1900
        poll(lambda: gateway_idle(gw.state(m)), 2.0)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/embeddings", {"model": "tiny", "input": TEXT}),
        ("/score", {"model": "tiny", "text_1": "queues", "text_2": ["queues", "cake"]}),
        ("/v1/rerank", {"model": "tiny", "query": "queues", "documents": ["queues", "cake"]}),
    ],
)
def test_pooling_routes_come_back_as_vllm_answers_them(
    vllm: VllmServer, start_gateway: Any, path: str, body: dict[str, Any]
) -> None:
    gw = start_gateway(gateway_config(vllm.url))
    with httpx.Client(timeout=30) as c:
        direct = c.post(f"{vllm.url}{path}", json=body)
        through = c.post(f"{gw.url}{path}", json=body)
    print(f"{path}: vLLM answers {direct.status_code} for the tiny generative model")
    assert through.status_code == direct.status_code, through.text
    if direct.status_code == 200:
        assert through.json().keys() == direct.json().keys()
        if path == "/v1/embeddings":
            assert through.json()["data"][0]["embedding"] == direct.json()["data"][0]["embedding"]
    else:  # vLLM's own answer (FastAPI's `detail` for a route it lacks), in OpenAI's shape
        error = through.json()["error"]
        assert error["code"] == "backend_rejected"
        assert path in error["message"] or direct.status_code != 404
