"""Shadow mode, checked from outside: clients get what vLLM answers, and the would-have counts
equal what enforce mode does to the same traffic.

One scripted traffic (`_replay`) runs twice against a deterministic fake vLLM: once under
`gate.mode: enforce`, where what the policy did is read off the wire (statuses, error codes,
the truncation marker, requests that reached vLLM late), and once under `gate.mode: shadow`,
where every reply must be vLLM's own and `/metrics`' `llmflow_shadow_*` must say the same as
the enforce run's wire. The script paces itself on events, not clocks: replies the fake holds
(`step`) until the test releases them, and one total deadline that both runs cross. A
deterministic fake (not the simulator) keeps the two runs' event sequences identical, which is
what makes equal counts a fair expectation; docs/gateway.md says where real traffic departs.

Each runs on both paths: the native front's (the default) and Python's (the app alone);
the core mirrors both to the one policy runtime, so the two give the same verdicts.
"""

from __future__ import annotations

import asyncio
import csv
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmflow._core import replay_trace
from llmflow.config import load_settings
from llmflow.gateway.app import create_app
from llmflow.gateway.shadow import forwarding_config, uncapped_light

from .both_paths import on_each_path, paths
from .fake_vllm import FakeVllm
from .goldens import plain, with_reference
from .harness import (
    NATIVE_IDS,
    serve_asgi,
    serve_gateway,
    settings_for,
    start_gateway,
    until,
)
from .otlp_receiver import OtlpReceiver

if TYPE_CHECKING:
    from pathlib import Path

    from .harness import Harness

pytestmark = pytest.mark.anyio

ALPHA_KEY = "ak-shadow-alpha-0000001"
BETA_KEY = "ak-shadow-beta-00000002"
SECTIONS: dict[str, Any] = {
    "tiers": [{"name": "normal"}],
    "default_tier": "normal",
    "tenants": [
        {"name": "alpha", "tier": "normal", "api_keys": [ALPHA_KEY]},
        # one request, then 429 rate_limited for a hundred seconds
        {"name": "beta", "tier": "normal", "api_keys": [BETA_KEY], "requests_per_s": 0.01},
    ],
    # two run, one waits, the rest are refused: queue_full
    "gate": {
        "max_concurrency_per_gpu": 2,
        "headroom_quantile": None,
        "queue": {"max_waiting": 1, "follow_drain": False, "max_wait_ms": None},
    },
    "streaming": {"first_token_timeout_ms": None},
    "sla": {"ttft_ms": None},
    "timeouts": {"total_ms": 1500},  # held replies are cut here (enforce)
}
TOKENS = 8  # each request's max_tokens: what vLLM generates for it
PATHS = on_each_path()


@dataclass
class Seen:
    """What one run's clients saw, per request, and what the fake vLLM saw."""

    replies: dict[str, tuple[int, Any]] = field(default_factory=dict)  # name -> status, answer
    held_back: int = 0  # requests the gateway had not sent to vLLM while others ran
    peak_running: int = 0


def _body(stream: bool, **fake: Any) -> dict[str, Any]:
    return {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": TOKENS,
        "stream": stream,
        "fake": fake,
    }


async def _ask(client: httpx.AsyncClient, key: str, body: dict[str, Any]) -> tuple[int, Any]:
    """One request: (status, the answer as the client read it: the streamed text, the chunks'
    finish reasons and truncation marker, or the JSON body)."""
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        raw = (await r.aread()).decode()
    if r.status_code != 200 or not body["stream"]:
        answer = json.loads(raw)
        if r.status_code == 200:
            choice = answer["choices"][0]
            return 200, (choice["message"]["content"], choice["finish_reason"],
                         answer.get("llmflow"))
        return r.status_code, (answer["error"]["code"], answer["error"]["message"])
    text, finish, marker = "", None, None
    for line in raw.splitlines():
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        marker = chunk.get("llmflow") or marker
        for choice in chunk.get("choices", []):
            text += choice.get("delta", {}).get("content") or ""
            finish = choice.get("finish_reason") or finish
    return 200, (text, finish, marker)


async def _replay(h: Harness, shadow: bool) -> Seen:
    """The traffic, the same in both modes; returns what was seen of it."""
    seen, c, fake = Seen(), h.client, h.fake
    runtime = h.gateway.runtime  # the one that runs them (shadow: the forwarding one)
    seen.replies["r1"] = await _ask(c, BETA_KEY, _body(False))
    seen.replies["r2"] = await _ask(c, BETA_KEY, _body(False))  # over beta's rate
    held = {name: asyncio.create_task(_ask(c, ALPHA_KEY, _body(True, step=True)))
            for name in ("a1", "a2")}
    await until(lambda: fake.running == 2)
    # a3's deadline comes well after a1's and a2's: a1's cut starts it, its own cuts it, even
    # if a loaded loop fires the timer late (else one late fire could expire all three at once)
    await asyncio.sleep(0.3)
    held["a3"] = asyncio.create_task(_ask(c, ALPHA_KEY, _body(True, step=True)))
    await until(lambda: runtime.live == 3)
    for name in ("a4", "a5"):  # no place left to wait in
        held[name] = asyncio.create_task(_ask(c, ALPHA_KEY, _body(False, step=True)))
    await until(lambda: runtime.live + held["a4"].done() + held["a5"].done() == 5)
    if shadow:  # nothing is held back: all five reach vLLM (fails here on timeout if not)
        await until(lambda: fake.running == 5)
    seen.held_back = runtime.live - fake.running  # live here, not yet at vLLM
    if shadow:  # /api/state shows the policy's view beside what runs
        state = (await c.get("/api/state")).json()
        assert (state["core"]["running"], state["core"]["queued"]) == (5, 0)
        assert (state["shadow"]["running"], state["shadow"]["queued"]) == (2, 1)
    if shadow:  # past every total deadline: the policy runtime has cut what it would have
        assert h.gateway.shadow is not None
        policy = h.gateway.shadow.policy.runtime
        await until(lambda: policy.live == 0, timeout_s=10)
        fake.release(5 * TOKENS)
    await asyncio.wait(held.values())
    seen.replies |= {name: task.result() for name, task in held.items()}
    seen.replies["e1"] = await _ask(c, ALPHA_KEY, _body(False, status=400))  # vLLM refuses it
    seen.peak_running = fake.peak_running
    return seen


def _enforced(seen: Seen) -> tuple[Counter[str], Counter[str]]:
    """What enforce mode did, read off the wire: refusals and cuts by reason."""
    refused: Counter[str] = Counter()
    cut: Counter[str] = Counter()
    for name, (status, answer) in seen.replies.items():
        if name == "e1":
            continue  # vLLM's own refusal, not the policy's
        if status != 200:
            refused[answer[0]] += 1
        elif answer[2] is not None:
            cut[answer[2]["reason"]] += 1
    return refused, cut


def _shadow_counts(text: str) -> dict[str, Counter[str]]:
    counts: dict[str, Counter[str]] = {"refused": Counter(), "cut": Counter(), "queued": Counter()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for what, tally in counts.items():
                if sample.name == f"llmflow_shadow_{what}_total" and sample.value:
                    assert sample.labels["tier"] == "normal"
                    tally[sample.labels.get("reason", "")] += int(sample.value)
    return counts


async def _direct_answer(body: dict[str, Any]) -> tuple[int, Any]:
    """What the fake vLLM answers to `body` with no gateway in between."""
    fake = FakeVllm()
    async with serve_asgi(fake.app) as (url, _), httpx.AsyncClient(base_url=url) as client:
        status, answer = await _ask(client, "none", {**body, "stream": True})  # it streams
    return status, answer


async def _settled(h: Harness) -> None:
    """Every verdict taken (a native request's with its record, at most a tick late), and the
    policy runtime holds nothing."""
    assert h.gateway.shadow is not None
    policy = h.gateway.shadow.policy.runtime
    await until(lambda: h.gateway.runtime.shadow_held == 0, timeout_s=5)
    assert (policy.live, policy.running, policy.queued) == (0, 0, 0)


def _rows(log: Path, native: bool) -> dict[str, dict[str, str]]:
    """The access log's rows by request id, each served by the path under test."""
    with log.open() as f:
        rows = {row["request"]: row for row in csv.DictReader(f)}
    for request_id in rows:
        assert (int(request_id.removeprefix("llmflow-")) >= NATIVE_IDS) == native, request_id
    return rows


@PATHS
async def test_shadow_answers_as_direct_and_counts_what_enforce_does(
    tmp_path: Path, native: bool
) -> None:
    async with start_gateway(**SECTIONS, native=native) as h:
        enforce = await _replay(h, shadow=False)
    log = tmp_path / "access.csv"
    sections = {**SECTIONS, "gate": {**SECTIONS["gate"], "mode": "shadow"},
                "server": {"access_log": str(log)}}
    async with start_gateway(**sections, native=native) as h:
        shadow = await _replay(h, shadow=True)
        await _settled(h)
        metrics = (await h.client.get("/metrics")).text

    # Enforce mode governed: two ran at once, one waited, the rest were refused or cut.
    refused, cut = _enforced(enforce)
    assert refused == {"rate_limited": 1, "queue_full": 2}
    assert cut == {"deadline": 3}  # a1, a2; and a3, started by a1's cut
    assert (enforce.held_back, enforce.peak_running) == (1, 2)

    # Shadow mode forwarded everything at once, and every reply is vLLM's own.
    assert (shadow.held_back, shadow.peak_running) == (0, 5)
    whole = ("".join(f"t{i} " for i in range(TOKENS)), "length", None)
    assert {n: r for n, r in shadow.replies.items() if n != "e1"} == {
        n: (200, whole) for n in ("r1", "r2", "a1", "a2", "a3", "a4", "a5")
    }
    direct = await _direct_answer(_body(False, status=400))
    assert direct == (400, (400, "injected failure"))  # the fake's own error object
    for run in (shadow, enforce):
        status, (_code, message) = run.replies["e1"]
        assert (status, message) == (400, "injected failure")
    assert (await _direct_answer(_body(True)))[1] == whole

    # ... while it counted exactly what enforce mode did.
    counts = _shadow_counts(metrics)
    assert counts["refused"] == refused
    assert counts["cut"] == cut
    assert counts["queued"] == {"": enforce.held_back}

    # The access log says it per request, in its `shadow` column.
    rows = _rows(log, native)
    verdicts = Counter(row["shadow"] for row in rows.values())
    assert verdicts == {
        "start": 2,  # r1, and e1 (vLLM's 400 is not the policy's)
        "refuse:rate_limited": 1,
        "refuse:queue_full": 2,
        "start>cut:deadline": 2,
        "queue>start>cut:deadline": 1,
    }
    assert {row["outcome"] for row in rows.values()} == {"completed", "failed"}


@PATHS
async def test_the_policy_runtime_trace_replays(tmp_path: Path, native: bool) -> None:
    """`llmflow serve --trace` in shadow mode records the policy runtime: it replays exactly,
    refusals and the queue included."""
    path = tmp_path / "shadow.jsonl"
    fake = FakeVllm()
    async with serve_asgi(fake.app) as (backend, _):
        settings = settings_for({"b0": backend}, **{
            **SECTIONS, "gate": {**SECTIONS["gate"], "mode": "shadow"}, "timeouts": {}})
        with path.open("w") as trace:
            app = create_app(settings, trace)
            async with serve_gateway(app, front=native) as url, \
                    httpx.AsyncClient(base_url=url, timeout=30) as c:
                held = [asyncio.create_task(_ask(c, ALPHA_KEY, _body(True, step=True)))
                        for _ in range(5)]
                await until(lambda: fake.running == 5)
                fake.release(5 * TOKENS)
                replies = await asyncio.gather(*held)
    assert [status for status, _ in replies] == [200] * 5
    text = path.read_text()
    assert '"queue_full"' in text  # the policy refused two, and the trace says so
    events, actions = replay_trace(text)
    assert events > 5 * 4
    assert actions > 5


@PATHS
async def test_a_client_leaving_while_the_policy_holds_it_waiting(native: bool) -> None:
    """The policy hears the client leave at once (its queue empties, as enforce mode's would),
    and the real request, already at vLLM, is aborted there."""
    sections = {**SECTIONS, "gate": {**SECTIONS["gate"], "mode": "shadow",
                                     "max_concurrency_per_gpu": 1}}
    async with start_gateway(**sections, native=native) as h:
        assert h.gateway.shadow is not None
        policy = h.gateway.shadow.policy.runtime
        first = asyncio.create_task(_ask(h.client, ALPHA_KEY, _body(True, step=True)))
        await until(lambda: h.fake.running == 1)
        leaving = asyncio.create_task(_ask(h.client, ALPHA_KEY, _body(True, step=True)))
        await until(lambda: h.fake.running == 2)
        assert (policy.running, policy.queued) == (1, 1)
        leaving.cancel()  # the client closes its connection
        await until(lambda: h.fake.aborted == 1)
        assert (policy.running, policy.queued) == (1, 0)
        h.fake.release(TOKENS)
        assert (await first)[0] == 200
        await _settled(h)
        metrics = (await h.client.get("/metrics")).text
    counts = _shadow_counts(metrics)
    assert (counts["queued"], counts["refused"], counts["cut"]) == ({"": 1}, {}, {})


async def test_both_paths_give_the_same_verdicts(tmp_path: Path) -> None:
    """The same traffic in shadow mode, served by the native front and by Python: the same
    would-have counts and the same verdict per request, every reply vLLM's own."""
    seen: dict[bool, tuple[dict[str, Counter[str]], Counter[str], Seen]] = {}
    for native in paths():
        log = tmp_path / f"access-{native}.csv"
        sections = {**SECTIONS, "gate": {**SECTIONS["gate"], "mode": "shadow"},
                    "server": {"access_log": str(log)}}
        async with start_gateway(**sections, native=native) as h:
            run = await _replay(h, shadow=True)
            await _settled(h)
            counts = _shadow_counts((await h.client.get("/metrics")).text)
        verdicts = Counter(row["shadow"] for row in _rows(log, native).values())
        seen[native] = (counts, verdicts, run)
    # the Python path's, held to their goldens (the reference alone once it is gone)
    python = [
        with_reference([plain(seen[n][i]) for n in paths()], part)[1]
        for i, part in ((0, "would-have counts"), (1, "verdicts"))
    ]
    python.append(with_reference([plain(seen[n][2].replies) for n in paths()], "replies")[1])
    assert seen[True][0] == python[0]
    assert seen[True][0]["refused"] == {"rate_limited": 1, "queue_full": 2}
    assert seen[True][1] == python[1]
    assert plain(seen[True][2].replies) == python[2]


async def test_native_bytes_in_shadow_mode_are_the_forwarded_answer() -> None:
    """On the native front, shadow mode writes the client what the unlimited forwarding runtime
    lets vLLM answer: byte for byte what enforce mode writes for a request it lets through,
    though the policy would have refused it (beta's second request, over its rate)."""
    bodies: dict[str, list[bytes]] = {}
    for mode in ("enforce", "shadow"):
        sections = {**SECTIONS, "gate": {**SECTIONS["gate"], "mode": mode}}
        async with start_gateway(**sections) as h:
            headers = {"Authorization": f"Bearer {BETA_KEY}"}
            raw = []
            for stream in (True, False):
                reply = await h.client.post(
                    "/v1/chat/completions", json=_body(stream), headers=headers)
                assert int(reply.headers["x-request-id"].removeprefix("llmflow-")) >= NATIVE_IDS
                raw.append(reply.content)
            if mode == "shadow":
                await _settled(h)
                counts = _shadow_counts((await h.client.get("/metrics")).text)
                assert counts["refused"] == {"rate_limited": 1}
        bodies[mode] = raw
    def timeless(raw: bytes) -> bytes:  # each reply says when it was made
        return re.sub(rb'"created":\s*\d+', b'"created":0', raw)

    assert timeless(bodies["enforce"][0]) == timeless(bodies["shadow"][0])  # let through by both
    assert bodies["shadow"][1] != bodies["enforce"][1]  # enforce refused the second
    whole = ("".join(f"t{i} " for i in range(TOKENS)), "length", None)
    answer = json.loads(bodies["shadow"][1])
    choice = answer["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"], answer.get("llmflow")) == whole


def test_the_forwarding_runtime_holds_nothing_back() -> None:
    """The forwarding config keeps the backends, tiers and tenants, and drops every limit."""
    settings = load_settings(data={**SECTIONS, "gate": {**SECTIONS["gate"], "mode": "shadow"}})
    config = forwarding_config(settings)
    policy = config["policy"]
    assert policy["max_concurrency_per_gpu"] >= 100_000
    assert [t["name"] for t in policy["tenants"]] == ["alpha", "beta", "anonymous"]
    assert all("requests_per_s" not in t for t in policy["tenants"])
    assert policy["routing"]["policy"] == "round_robin"
    assert config["lifecycle"]["stall_timeout_ms"] is None
    light = uncapped_light(settings)  # the light lane's caps are lifted too
    assert [b.light_concurrency >= 100_000 for b in light.backends] == [True]
    assert settings.backends[0].light_concurrency == 16


def test_shadow_mode_refuses_what_it_cannot_shadow() -> None:
    from llmflow.config import ConfigFileError

    with pytest.raises(ConfigFileError, match="shadow runs on one gateway alone"):
        load_settings(data={"gate": {"mode": "shadow"},
                            "state": {"backend": "redis", "url": "redis://127.0.0.1:1/0"}})
    with pytest.raises(ConfigFileError, match="no prefill/decode proxy"):
        load_settings(data={"gate": {"mode": "shadow"}, "backends": [
            {"name": "p", "role": "prefill"}, {"name": "d", "role": "decode"}]})


@PATHS
async def test_the_span_says_what_the_policy_would_have_done(native: bool) -> None:
    """Beta's second request is forwarded (vLLM answers it) and its span carries the refusal
    the policy would have given it, on either path."""
    spans: dict[str, dict[str, Any]] = {}
    with OtlpReceiver() as rx:
        sections = {**SECTIONS, "gate": {**SECTIONS["gate"], "mode": "shadow"},
                    "telemetry": {"otlp_endpoint": rx.url}}
        async with start_gateway(**sections, native=native) as h:
            ids = []
            for _ in range(2):
                reply = await h.client.post("/v1/chat/completions", json=_body(False),
                                            headers={"Authorization": f"Bearer {BETA_KEY}"})
                assert reply.status_code == 200
                ids.append(reply.headers["x-request-id"])
            await _settled(h)
        # the gateway has stopped: its last spans are flushed
    for span in rx.named("llmflow.request"):
        spans[span.attributes["llmflow.request_id"]] = span.attributes
    assert [(int(i.removeprefix("llmflow-")) >= NATIVE_IDS) for i in ids] == [native] * 2
    first, second = (spans[i] for i in ids)
    assert (first["llmflow.shadow.verdict"], first["llmflow.shadow.backend"]) == ("start", "b0")
    assert {k: v for k, v in second.items() if k.startswith("llmflow.shadow.")
            and k != "llmflow.shadow.retry_after_s"} == {
        "llmflow.shadow.verdict": "refuse:rate_limited",
        "llmflow.shadow.reason": "rate_limited",
        "llmflow.shadow.status": 429,
    }
    assert second["llmflow.shadow.retry_after_s"] > 0
