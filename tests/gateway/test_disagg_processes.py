"""P/D disaggregation as it runs in production: `llmflow serve --trace` in front of three
`llmflow simserve --kv-transfer` processes (two prefill instances, one decode instance).

Streams go through the two hops; a client with a long prompt leaves at once; a prefill
instance is killed, and the next requests prefill on the one left. The trace must replay bit
for bit, and it must hold the hand-off: every start names a prefill instance, every hop that
answered a `prefilled` event. Every completion is the native front's, as its request ids say
(the front's are from 2^40).
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest

from tests.gateway.harness import NATIVE_IDS
from tests.processes import GatewayProcess, SimServeProcess, replays_exactly

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

MODEL = "sim"


def _config(urls: dict[str, str]) -> dict[str, Any]:
    roles = {"p0": "prefill", "p1": "prefill", "d0": "decode"}
    return {
        "gate": {"max_concurrency_per_gpu": 2},
        "streaming": {"sse_flush_interval": 0},
        "metrics": {"scrape_interval_ms": 100},
        "server": {"drain_timeout_ms": 1000},
        "backends": [
            {"name": name, "url": url, "models": [MODEL], "max_model_len": 8192,
             "role": roles[name], "gpus": 2 if name == "d0" else 1}
            for name, url in urls.items()
        ],
    }


def _lines(trace: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in trace.splitlines() if line.strip()]


async def _chat(client: openai.AsyncOpenAI, words: int, max_tokens: int) -> str:
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "word " * words}],
        max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True},
    )
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


async def test_split_serving_through_processes_replays_from_its_trace(tmp_path: Path) -> None:
    trace_path = tmp_path / "gateway.jsonl"
    args = ("--model-name", MODEL, "--speed", "4", "--kv-transfer")
    with (
        SimServeProcess(tmp_path, *args) as p0,
        SimServeProcess(tmp_path, *args) as p1,
        SimServeProcess(tmp_path, *args) as d0,
    ):
        urls = {"p0": p0.url, "p1": p1.url, "d0": d0.url}
        gateway = GatewayProcess(
            _config(urls), tmp_path, extra_args=("--trace", str(trace_path))
        )
        with gateway:
            async with openai.AsyncOpenAI(
                base_url=gateway.openai_base_url, api_key="k", max_retries=0, timeout=60
            ) as client:
                texts = await asyncio.gather(*(_chat(client, 300, 30) for _ in range(6)))
                assert [len(t.split()) for t in texts] == [30] * 6
                # A client with a long prompt that leaves at once (likely on its prefill hop).
                async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as raw:
                    body = {"model": MODEL, "stream": True, "max_tokens": 10,
                            "messages": [{"role": "user", "content": "word " * 5000}]}
                    leaver = asyncio.create_task(raw.post("/v1/chat/completions", json=body))
                    await asyncio.sleep(0.05)
                    leaver.cancel()
                    await asyncio.gather(leaver, return_exceptions=True)
                p1.kill()
                # Once a scrape has marked p1 down, every request prefills on p0.
                for _ in range(50):
                    states = httpx.get(gateway.url + "/api/state").json()["core"]["backends"]
                    if not next(b for b in states if b["name"] == "p1")["healthy"]:
                        break
                    await asyncio.sleep(0.1)
                after = await asyncio.gather(*(_chat(client, 200, 10) for _ in range(4)))
                assert [len(t.split()) for t in after] == [10] * 4
            assert gateway.stop() == 0
        trace = trace_path.read_text(encoding="utf-8")

    replays_exactly(trace_path)
    lines = _lines(trace)
    starts = [a["start"] for line in lines for a in line.get("act") or [] if "start" in a]
    assert len(starts) >= 11, starts
    names = ["p0", "p1", "d0"]
    assert all(names[s["backend"]] == "d0" for s in starts), starts
    assert all(names[s["prefill"]["backend"]] in ("p0", "p1") for s in starts), starts
    assert all(names[s["prefill"]["backend"]] == "p0" for s in starts[-4:]), starts[-4:]
    assert all(s["id"] >= NATIVE_IDS for s in starts), starts
    events = [line["ev"] for line in lines if isinstance(line.get("ev"), dict)]
    prefilled = [ev for ev in events if "prefilled" in ev]
    assert len(prefilled) >= 10, len(prefilled)
    assert '"backend":{"backend":1,"healthy":false}' in trace
