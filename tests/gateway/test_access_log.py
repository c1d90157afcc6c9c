"""The access log (`server.access_log`): one row per request, checked against what the test sent
and received, then replayed in the simulator as a trace."""

from __future__ import annotations

import csv
import time
from typing import TYPE_CHECKING, Any

import openai
import pytest

from llmflow.request_log import COLUMNS
from llmflow.sim.runner import run_scenario
from llmflow.sim.scenario import load_scenario
from llmflow.sim.workload import build_requests

from .harness import SIM_MODEL, start_sim_gateway

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.anyio

ALPHA_KEY = "ak-access-log-alpha-0001"
BETA_KEY = "ak-access-log-beta-00002"
TENANTS = [
    {"name": "alpha", "tier": "vip", "api_keys": [ALPHA_KEY]},
    # one request, then a 429 rate_limited until a hundred seconds have passed
    {"name": "beta", "tier": "normal", "api_keys": [BETA_KEY], "requests_per_s": 0.01},
]


def _ids(n: int) -> list[int]:
    return [1000 + i for i in range(n)]  # token ids: the gateway counts them exactly


async def _send(url: str) -> list[dict[str, Any]]:
    """The test's requests and what it saw of each on the wire."""
    sent: list[dict[str, Any]] = []
    async with (
        openai.AsyncOpenAI(base_url=url + "/v1", api_key=ALPHA_KEY, max_retries=0) as alpha,
        openai.AsyncOpenAI(base_url=url + "/v1", api_key=BETA_KEY, max_retries=0) as beta,
    ):
        t0 = time.time()
        reply = await alpha.completions.create(
            model=SIM_MODEL, prompt=_ids(37), max_tokens=9, extra_body={"ignore_eos": True}
        )
        assert reply.usage is not None
        sent.append(
            {
                "tenant": "alpha",
                "prompt": 37,
                "output": reply.usage.completion_tokens,
                "t0": t0,
                "t1": time.time(),
            }
        )
        t0 = time.time()
        stream = await alpha.completions.create(
            model=SIM_MODEL,
            prompt=_ids(21),
            max_tokens=14,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream if c.choices and c.choices[0].text]
        sent.append(
            {"tenant": "alpha", "prompt": 21, "output": len(chunks), "t0": t0, "t1": time.time()}
        )
        t0 = time.time()
        reply = await beta.completions.create(
            model=SIM_MODEL, prompt=_ids(11), max_tokens=5, extra_body={"ignore_eos": True}
        )
        assert reply.usage is not None
        sent.append(
            {
                "tenant": "beta",
                "prompt": 11,
                "output": reply.usage.completion_tokens,
                "t0": t0,
                "t1": time.time(),
            }
        )
        t0 = time.time()
        with pytest.raises(openai.RateLimitError) as refused:
            await beta.completions.create(model=SIM_MODEL, prompt=_ids(13), max_tokens=5)
        sent.append(
            {
                "tenant": "beta",
                "prompt": 13,
                "output": 0,
                "t0": t0,
                "t1": time.time(),
                "id": refused.value.response.headers["x-request-id"],
            }
        )
    return sent


async def test_the_access_log_holds_what_went_over_the_wire(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "access.csv"
    async with start_sim_gateway(server={"access_log": str(log)}, tenants=TENANTS) as h:
        sent = await _send(h.url)
    lines = log.read_text().splitlines()
    assert tuple(lines[0].split(",")) == COLUMNS
    rows = {(r["tenant"], int(r["prompt_tokens"])): r for r in csv.DictReader(lines)}
    assert len(rows) == len(sent) == len(lines) - 1
    for s in sent:
        row = rows[s["tenant"], s["prompt"]]
        assert int(row["output_tokens"]) == s["output"]
        assert row["class"] == {"alpha": "vip", "beta": "normal"}[s["tenant"]]
        assert row["attempts"] == "1"
        arrival, end = float(row["arrival_s"]), float(row["end_s"])
        assert s["t0"] - 0.05 <= arrival <= end <= s["t1"] + 0.05  # Unix time, as the test saw
        if s["output"]:
            assert (row["outcome"], row["reason"], row["backend"]) == ("completed", "", "sim0")
            assert arrival <= float(row["admitted_s"]) <= float(row["first_token_s"]) <= end
        else:
            assert (row["outcome"], row["reason"]) == ("rejected", "rate_limited")
            assert row["request"] == s["id"]
            assert row["admitted_s"] == row["first_token_s"] == row["backend"] == ""

    # a real run replayed in the simulator: one class per tenant, the log as their trace
    scenario = tmp_path / "replay.yaml"
    scenario.write_text(
        "title: replay\nduration_s: 60\ncluster: [{name: h, gpu: h100, model: llama-3-8b}]\n"
        "workload:\n"
        "  - {name: a, tenant: alpha, tier: vip,\n"
        "     arrival: {kind: trace, path: logs/access.csv, tenant: alpha}}\n"
        "  - {name: b, tenant: beta, arrival: {kind: trace, path: logs/access.csv, "
        "tenant: beta}}\n"
    )
    sc = load_scenario(scenario)
    reqs = build_requests(sc)
    first = min(float(r["arrival_s"]) for r in rows.values())
    expected = sorted(
        (float(r["arrival_s"]) - first, int(r["prompt_tokens"]), max(int(r["output_tokens"]), 1))
        for r in rows.values()
    )
    got = list(zip(reqs.t.tolist(), reqs.prompt.tolist(), reqs.eos.tolist(), strict=True))
    assert [g[1:] for g in got] == [e[1:] for e in expected]
    assert [g[0] for g in got] == pytest.approx([e[0] for e in expected], abs=1e-5)
    report, runs = run_scenario(sc, ["llmflow"])
    assert report["requests"] == len(sent)
    assert sorted(r[8] for r in runs[0].requests) == sorted(s["prompt"] for s in sent)
