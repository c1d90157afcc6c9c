"""Prefill/decode disaggregation through the gateway: two simulated vLLM prefill instances and
one decode instance that model vLLM's KV hand-off (`llmflow.sim.server_pd`), real HTTP.

What each backend was sent and how many requests it held at once is counted by a wrapper
around each simulated server (`Recorder`), not by the gateway; what the backends computed is
read from their own `/metrics`.

Each check runs on both paths: the native front's (the default; its requests' ids are from the
front's range, which the backends see in `X-Request-Id`) and Python's (the app alone);
the hops each backend received and the replies the client read are compared byte for byte
between the two, and held to their goldens, the Python path's recorded (`goldens`), which
are the reference alone once the Python path is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest

from llmflow.config import load_settings
from llmflow.gateway.app import create_app
from llmflow.sim import server as sim_server
from llmflow.sim.server_pd import KvTransfer

from .both_paths import on_each_path, paths
from .goldens import with_reference
from .harness import (
    SIM_MODEL,
    Harness,
    assert_idle,
    port_refuses,
    serve_asgi,
    serve_gateway,
    served_by,
    settings_for,
    until,
)
from .sse_client import frames
from .test_front_tls import _exchange

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = pytest.mark.anyio
# Each test on both paths: the native front's (the default) and Python's (the app alone).
PATHS = on_each_path()


@dataclass
class Recorder:
    """ASGI wrapper: the JSON bodies sent to `/v1/*` (parsed, and as they came), the bodies it
    answered an unstreamed request with, and the most in flight at once."""

    app: Any
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    raw: list[bytes] = field(default_factory=list)
    answers: list[bytes] = field(default_factory=list)
    in_flight: int = 0
    peak: int = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        self.raw.append(b"".join(chunks))
        self.bodies.append(json.loads(self.raw[-1]))
        self.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
        replayed = False
        answer: list[bytes] | None = [] if self.bodies[-1].get("stream") is False else None

        async def sent(message: Any) -> None:
            if answer is not None and message["type"] == "http.response.body":
                answer.append(message.get("body", b""))
                if not message.get("more_body"):
                    self.answers.append(b"".join(answer))
            await send(message)

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await self.app(scope, replay, sent)
        finally:
            self.in_flight -= 1


def sim_app(link_gb_s: float, speed: float, max_model_len: int = 4096, kv: bool = True) -> Any:
    """A simulated vLLM; `kv`: with its KV connector (else it answers no KV parameters)."""
    return sim_server.create_app(
        preset="h100:llama-3-8b", speed=speed, models=[SIM_MODEL], max_model_len=max_model_len,
        kv_transfer=KvTransfer(bandwidth_gb_s=link_gb_s, latency_ms=1.0) if kv else None,
    )


@dataclass
class Split:
    harness: Harness
    recorders: dict[str, Recorder]
    urls: dict[str, str]
    servers: dict[str, Any]  # each backend's uvicorn server

    async def metric(self, backend: str, name: str) -> float:
        text = (await self.harness.client.get(self.urls[backend] + "/metrics")).text
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(name) and not line.startswith("#")
        )


@contextlib.asynccontextmanager
async def split_gateway(
    link_gb_s: float = 50.0, speed: float = 5.0, backend: dict[str, Any] | None = None,
    prefill_max_model_len: int = 4096, native: bool = True, trace: io.StringIO | None = None,
    prefill_kv: bool = True, **sections: Any,
) -> AsyncIterator[Split]:
    """p0, p1 (prefill, one slot each) and d0 (decode, four slots) behind a gateway: H100s
    with Llama-3-8B at `speed` times real time; `native`: the front serves the completions
    (else the app alone, Python: `serve_gateway(front=False)`); `trace`: where the runtime's
    trace goes; `prefill_kv`: the prefill instances run vLLM's KV connector."""
    recorders = {
        name: Recorder(
            sim_app(link_gb_s, speed, prefill_max_model_len, prefill_kv)
            if name[0] == "p" else sim_app(link_gb_s, speed)
        )
        for name in ("p0", "p1", "d0")
    }
    async with contextlib.AsyncExitStack() as stack:
        urls, servers = {}, {}
        for name, recorder in recorders.items():
            urls[name], servers[name] = await stack.enter_async_context(serve_asgi(recorder))
        per_backend = {
            "p0": {"role": "prefill"}, "p1": {"role": "prefill"},
            "d0": {"role": "decode", "gpus": 4},
        }
        sections = {"gate": {"max_concurrency_per_gpu": 1}, **sections}
        settings = settings_for(urls, backend, per_backend, **sections)
        app = create_app(settings, trace)
        url = await stack.enter_async_context(serve_gateway(app, front=native))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=60))
        harness = Harness(url, app.state.gateway, client, {}, app)
        yield Split(harness, recorders, urls, servers)
        await assert_idle(harness)


@PATHS
async def test_a_split_request_prefills_on_one_instance_and_decodes_on_another(
    native: bool,
) -> None:
    async with split_gateway(backend={"scheduling_policy": "priority"}, native=native) as s:
        prompt = "word " * 600  # ~600 tokens: 38 blocks to move
        async with openai.AsyncOpenAI(
            base_url=s.harness.url + "/v1", api_key="k", max_retries=0
        ) as c:
            stream = await c.chat.completions.create(
                model=SIM_MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=20,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, "min_tokens": 5},
            )
            chunks = [chunk async for chunk in stream]
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert len(text.split()) == 20
        metrics = s.harness.gateway.metrics
        assert metrics.relay is not None
        if native:
            # The decode hop streamed through the relay, which wrote every chunk; Python none.
            assert sum(metrics.relay.inter_chunk()[1]) > 0
            assert sum(metrics.inter_chunk.counts) == 0
        else:
            # The decode hop streamed through Python (the app alone), which lends the relay
            # no socket. The relay wrote nothing.
            assert sum(metrics.relay.inter_chunk()[1]) == 0
            assert sum(metrics.inter_chunk.counts) > 0
        usage = chunks[-1].usage
        assert usage is not None
        assert usage.completion_tokens == 20
        p0, p1, d0 = (s.recorders[n] for n in ("p0", "p1", "d0"))
        # The prefill hop, as vLLM's proxy sends it: one token, not streamed, remote decode.
        assert (len(p0.bodies), len(p1.bodies), len(d0.bodies)) == (1, 0, 1)
        hop = p0.bodies[0]
        assert (hop["stream"], hop["max_tokens"]) == (False, 1)
        assert hop["kv_transfer_params"]["do_remote_decode"] is True
        assert not {"stream_options", "min_tokens"} & hop.keys()
        # Priorities: the hop's is its tier's alone (first come, first served on the prefill
        # instance); the decode's adds the request's KV footprint.
        assert hop["priority"] % 1000 == 0
        assert d0.bodies[0]["priority"] > hop["priority"]
        # The decode hop: the client's body plus what the prefill answered.
        decode = d0.bodies[0]
        assert (decode["stream"], decode["max_tokens"], decode["min_tokens"]) == (True, 20, 5)
        params = decode["kv_transfer_params"]
        assert params["do_remote_prefill"] is True
        assert params["remote_block_ids"]
        assert params["remote_port"] == int(s.urls["p0"].rsplit(":", 1)[1])
        assert p0.headers[0]["x-request-id"] == d0.headers[0]["x-request-id"]
        served_by(native, d0.headers[0]["x-request-id"])
        # The decode instance read the KV instead of computing the prompt: it prefilled only
        # the last prompt token (vLLM recomputes it), the prefill instance all of it; and the
        # prefill instance freed its blocks once they were read.
        computed = "llmflow_sim_prefill_computed_tokens_total"
        assert await s.metric("p0", computed) >= 600
        assert await s.metric("d0", computed) <= 16
        for _ in range(200):
            if await s.metric("p0", "vllm:kv_cache_usage_perc") == 0:
                break
            await asyncio.sleep(0.01)
        assert await s.metric("p0", "vllm:kv_cache_usage_perc") == 0


@PATHS
async def test_prefill_slots_and_decode_slots_each_bound_what_runs(native: bool) -> None:
    async with split_gateway(native=native) as s:
        body = {
            "model": SIM_MODEL, "messages": [{"role": "user", "content": "word " * 300}],
            "max_tokens": 40, "ignore_eos": True,
        }
        replies = await asyncio.gather(
            *(s.harness.client.post("/v1/chat/completions", json=body) for _ in range(12))
        )
        assert [r.status_code for r in replies] == [200] * 12
        assert all(r.json()["usage"]["completion_tokens"] == 40 for r in replies)
        p0, p1, d0 = (s.recorders[n] for n in ("p0", "p1", "d0"))
        # One slot per prefill instance, four on the decode instance, as configured; both
        # prefill instances took a share, and every request decoded on d0 only.
        assert (p0.peak, p1.peak) == (1, 1)
        assert 3 <= d0.peak <= 4
        assert (len(p0.bodies) + len(p1.bodies), len(d0.bodies)) == (12, 12)
        assert min(len(p0.bodies), len(p1.bodies)) >= 3
        assert all(b["kv_transfer_params"]["do_remote_decode"] for b in p0.bodies + p1.bodies)
        assert all(b["kv_transfer_params"]["do_remote_prefill"] for b in d0.bodies)
        served_by(native, *(h["x-request-id"] for h in d0.headers))
        # Each decode hop carried what its own prefill hop answered, under the same id.
        answered = {
            h["x-request-id"]: json.loads(a)["kv_transfer_params"]
            for r in (p0, p1) for h, a in zip(r.headers, r.answers, strict=True)
        }
        assert {h["x-request-id"]: b["kv_transfer_params"] for h, b in zip(
            d0.headers, d0.bodies, strict=True)} == answered


@PATHS
async def test_a_client_leaving_during_the_prefill_hop_aborts_it(native: bool) -> None:
    # A long prompt on a slow simulated GPU (a 3,000-token prefill takes ~0.15 s on an H100,
    # 3 s at 1/20 speed): the prefill hop is still running when the client goes; the prefill
    # instance must see its request end, and the decode never be sent.
    trace = io.StringIO()
    async with split_gateway(speed=0.05, native=native, trace=trace) as s:
        body = {
            "model": SIM_MODEL, "messages": [{"role": "user", "content": "word " * 2400}],
            "max_tokens": 10, "stream": True,
        }
        p0, p1 = s.recorders["p0"], s.recorders["p1"]
        task = asyncio.create_task(s.harness.client.post("/v1/chat/completions", json=body))
        await until(lambda: p0.in_flight + p1.in_flight == 1)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await until(lambda: p0.in_flight + p1.in_flight == 0)
        await until(lambda: s.harness.gateway.runtime.live == 0)
        await until(lambda: s.harness.gateway.relay.relay.live == 0)  # no hop left open
        assert s.recorders["d0"].bodies == []
        (hop,) = p0.headers + p1.headers
        served_by(native, hop["x-request-id"])
    # The runtime heard the client leave, and nothing of a hop that never answered.
    assert _fed(trace, hop["x-request-id"]) == ["arrive", "client_gone"]


@PATHS
async def test_a_first_token_streams_after_the_transfer(native: bool) -> None:
    # A slow link (0.05 GB/s): ~3,000 tokens of Llama-3-8B KV (128 KiB each) take ~8 s to
    # move, simulated, 1.6 s of wall time at 5x; the client's first token waits for them.
    content = "word " * 2400
    prompt = sim_server.estimate_tokens(content) + 4  # the chat template's 4
    async with split_gateway(link_gb_s=0.05, native=native) as s:
        body = {
            "model": SIM_MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 5, "stream": True, "ignore_eos": True,
        }
        loop = asyncio.get_running_loop()
        begin = loop.time()
        async with s.harness.client.stream("POST", "/v1/chat/completions", json=body) as r:
            it = frames(r)
            await anext(it)
            first = loop.time() - begin
            rest = [f async for f in it]
            served_by(native, r.headers["x-request-id"])
        assert rest
        moved = prompt * 128 * 1024 / 0.05e9 / 5.0  # wall seconds on the link
        assert first >= 0.8 * moved, (first, moved)


@PATHS
async def test_built_in_backends_can_be_split(native: bool) -> None:
    # Backends without a URL run the simulated vLLM in the gateway's process; with roles they
    # run its KV connector too, so a split config works on a bare machine.
    settings = load_settings(data={"backends": [
        {"name": "p", "models": [SIM_MODEL], "role": "prefill"},
        {"name": "d", "models": [SIM_MODEL], "role": "decode"},
    ]})
    app = create_app(settings)
    async with serve_gateway(app, front=native) as url, httpx.AsyncClient(
        base_url=url, timeout=30
    ) as client:
        body = {"model": SIM_MODEL, "prompt": "hello " * 50, "max_tokens": 8, "ignore_eos": True}
        reply = await client.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 8
        served_by(native, reply.headers["x-request-id"])
        state = (await client.get("/api/state")).json()
        roles = {b["name"]: b["role"] for b in state["core"]["backends"]}
        assert roles == {"p": "prefill", "d": "decode"}
        d_url = app.state.gateway.scraper.states["d"].url
        text = (await client.get(d_url + "/metrics")).text
        pulled = [line for line in text.splitlines()
                  if line.startswith("llmflow_sim_prefill_computed_tokens_total")]
        assert pulled
        assert float(pulled[0].rsplit(" ", 1)[1]) <= 16  # the KV came from p


@PATHS
async def test_a_prefill_hop_refused_by_vllm_reaches_the_client_and_leaks_nothing(
    native: bool,
) -> None:
    # The prefill instances run with a shorter context than the gateway was told: vLLM's 400
    # for the prompt comes back on the hop, passes through with its message, the decode is
    # never sent, and no slot stays held (`split_gateway` asserts the gateway idle at exit).
    async with split_gateway(prefill_max_model_len=1024, native=native) as s:
        body = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "word " * 1200}],
                "max_tokens": 10, "stream": True}
        reply = await s.harness.client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 400, reply.text
        assert "1024" in reply.json()["error"]["message"]
        served_by(native, reply.headers["x-request-id"])
        assert s.recorders["d0"].bodies == []
        ok = await s.harness.client.post("/v1/chat/completions", json={
            **body, "messages": [{"role": "user", "content": "hello"}], "stream": False})
        assert ok.status_code == 200, ok.text
        assert all(b.healthy for b in s.harness.gateway.scraper.states.values())


def _fed(trace: io.StringIO, request_id: str) -> list[str]:
    """The events the runtime was fed for `request_id` (`llmflow-<n>`), in order, by kind (a
    run of `tokens` as one: the relay hands them over in batches, Python chunk by chunk)."""
    rid = int(request_id.removeprefix("llmflow-"))
    kinds = []
    for line in trace.getvalue().splitlines():
        event = json.loads(line).get("ev")
        if isinstance(event, dict):
            ((kind, fields),) = event.items()
            ours = isinstance(fields, dict) and fields.get("id") == rid
            if ours and not (kind == "tokens" and kinds[-1:] == ["tokens"]):  # batched by path
                kinds.append(kind)
    return kinds


def _same_reply(native: bytes, python: bytes) -> None:
    """The native front's reply is the Python path's (as `_exchange` gives them); the Python
    path writes a stream's head in its own order (uvicorn's, with its `server`): the same
    fields otherwise, and the same body."""
    if b"text/event-stream" not in native.partition(b"\r\n\r\n")[0]:
        assert native == python
        return
    head, _, text = native.partition(b"\r\n\r\n")
    python_head, _, python_text = python.partition(b"\r\n\r\n")
    assert text == python_text
    assert sorted(head.split(b"\r\n")) == sorted(
        line for line in python_head.split(b"\r\n") if line != b"server: uvicorn"
    )


def _heads_sorted(reply: bytes) -> bytes:
    """A reply as `_same_reply` compares it (for its golden): a stream's head as its sorted
    lines less uvicorn's `server`, then its body; any other whole."""
    head, _, text = reply.partition(b"\r\n\r\n")
    if b"text/event-stream" not in head:
        return reply
    lines = sorted(line for line in head.split(b"\r\n") if line != b"server: uvicorn")
    return b"\r\n".join(lines) + b"\r\n\r\n" + text


def _hops(s: Split) -> tuple[bytes, bytes, str]:
    """The one prefill hop and the one decode hop the backends received, as they came, and
    their `X-Request-Id` (the same on both); the decode hop's `kv_transfer_params` checked to
    be those the prefill instance answered, written as `json.dumps` writes them, and then left
    out (they name the run's own engine, port and blocks)."""
    p0, p1, d0 = (s.recorders[n] for n in ("p0", "p1", "d0"))
    ((hop, answer, hop_headers),) = zip(
        p0.raw + p1.raw, p0.answers + p1.answers, p0.headers + p1.headers, strict=True
    )
    ((decode, decode_headers),) = zip(d0.raw, d0.headers, strict=True)
    assert hop_headers["x-request-id"] == decode_headers["x-request-id"]
    params = json.loads(answer)["kv_transfer_params"]
    assert json.loads(decode)["kv_transfer_params"] == params
    shown = json.dumps(params).encode()
    assert decode.count(shown) == 1, (decode, shown)
    return hop, decode.replace(shown, b"PARAMS"), decode_headers["x-request-id"]


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_both_paths_send_the_same_hops_and_give_the_same_reply(stream: bool) -> None:
    """The same request through the native front and through Python: the same prefill hop
    and decode hop, byte for byte (priorities, the client's fields, what vLLM's proxy drops),
    the same `prefilled` fed between them, and the same reply on the wire."""
    body = {
        "model": SIM_MODEL, "messages": [{"role": "user", "content": "word " * 300}],
        "max_tokens": 12, "ignore_eos": True, "min_tokens": 3, "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
    }
    body = {k: v for k, v in body.items() if v is not None}
    seen: dict[bool, tuple[bytes, bytes, bytes, list[str]]] = {}
    for native in paths():
        trace = io.StringIO()
        async with split_gateway(
            backend={"scheduling_policy": "priority"}, native=native, trace=trace
        ) as s:
            served_natively, reply = await _exchange(s.harness.url, body)
            assert served_natively == native
            hop, decode, request_id = _hops(s)
        seen[native] = (hop, decode, reply, _fed(trace, request_id))
    (hop, decode, reply, fed) = seen[True]
    python = tuple(
        with_reference([seen[n][i] for n in paths()], part, mask)[1]
        for i, part, mask in (
            (0, "prefill hop", None), (1, "decode hop", None), (2, "reply", _heads_sorted),
            (3, "fed", None),
        )
    )
    assert hop == python[0]
    assert decode == python[1]
    assert reply.startswith(b"HTTP/1.1 200 OK\r\n"), reply
    _same_reply(reply, python[2])
    if stream:
        assert reply.endswith(b"data: [DONE]\n\n")
    assert fed == python[3]
    assert fed == ["arrive", "prefilled", "started", "tokens", "done"], fed


async def test_a_failed_prefill_hop_is_the_python_paths_failure_byte_for_byte() -> None:
    """A prefill hop vLLM refuses (a prompt past the prefill instances' context: its 400,
    passed on) and one whose instance is gone (502 backend_unavailable): the same reply on the
    wire on both paths, the same events fed (the failure, with its status and whether the
    backend is down), no decode hop sent, nothing held."""
    long = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "word " * 1200}],
            "max_tokens": 10, "stream": True}
    short = {**long, "messages": [{"role": "user", "content": "hello"}]}
    seen: dict[tuple[str, bool], tuple[bytes, list[str]]] = {}
    for native in paths():
        trace = io.StringIO()
        async with split_gateway(
            prefill_max_model_len=1024, native=native, trace=trace,
            metrics={"scrape_interval_ms": 60_000, "stale_after_ms": 120_000},
        ) as s:
            served_natively, refused = await _exchange(s.harness.url, long)
            assert served_natively == native
            (refused_id,) = [h["x-request-id"] for h in s.recorders["p0"].headers
                             + s.recorders["p1"].headers]
            # Both prefill instances stop: the next hop's connect is refused (no scrape marks
            # them down before it: the next is a minute away).
            for name in ("p0", "p1"):
                s.servers[name].should_exit = True
            for name in ("p0", "p1"):
                port = int(s.urls[name].rsplit(":", 1)[1])
                await until(lambda port=port: port_refuses("127.0.0.1", port))
            served_natively, gone = await _exchange(s.harness.url, short)
            assert served_natively == native
            assert s.recorders["d0"].raw == []
            await until(lambda: s.harness.gateway.relay.relay.live == 0)  # no hop left open
        events = [line["ev"] for line in map(json.loads, trace.getvalue().splitlines())
                  if isinstance(line.get("ev"), dict)]
        ids = [ev["arrive"]["id"] for ev in events if "arrive" in ev]
        assert len(ids) == 2, ids
        seen["refused", native] = (refused, _fed(trace, refused_id))
        seen["gone", native] = (gone, _fed(trace, f"llmflow-{ids[1]}"))
        failures = [(ev["failed"]["status"], ev["failed"]["backend_down"])
                    for ev in events if "failed" in ev]
        assert failures == [(400, False), (502, True)]
    for case in ("refused", "gone"):
        python = tuple(
            with_reference([seen[case, n][i] for n in paths()], f"{case} {part}")[1]
            for i, part in ((0, "reply"), (1, "fed"))
        )
        assert seen[case, True] == python, case
    assert seen["refused", True][0].startswith(b"HTTP/1.1 400 "), seen["refused", True][0]
    assert b"1024" in seen["refused", True][0]
    assert seen["gone", True][0].startswith(b"HTTP/1.1 502 "), seen["gone", True][0]
    assert b'"code":"backend_unavailable"' in seen["gone", True][0]
    assert seen["refused", True][1] == ["arrive", "failed"]
    assert seen["gone", True][1] == ["arrive", "failed"]


@PATHS
async def test_a_prefill_instance_without_a_kv_connector_is_warned_of(
    native: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Prefill instances that answer no `kv_transfer_params` (no KV connector): the decode hop
    goes without any and computes the prompt itself, and the gateway logs the same warning on
    both paths (the native front's from the request's record, once it ended)."""
    caplog.set_level(logging.WARNING, logger="llmflow.gateway")
    async with split_gateway(native=native, prefill_kv=False) as s:
        body = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "word " * 300}],
                "max_tokens": 5, "ignore_eos": True}
        reply = await s.harness.client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 5
        request_id = reply.headers["x-request-id"]
        served_by(native, request_id)
        (decode,) = s.recorders["d0"].bodies
        assert "kv_transfer_params" not in decode
        assert await s.metric("d0", "llmflow_sim_prefill_computed_tokens_total") >= 300
        (url,) = [s.urls[n] for n in ("p0", "p1") if s.recorders[n].bodies]

        def warned() -> list[str]:
            return [r.getMessage() for r in caplog.records
                    if r.name == "llmflow.gateway" and "kv_transfer_params" in r.getMessage()]

        await until(lambda: bool(warned()))
    assert warned() == [
        f"prefill instance {url} answered {request_id} without kv_transfer_params: is vLLM's "
        "KV connector configured (--kv-transfer-config)? The decode instance computes the "
        "prompt again."
    ]


@pytest.mark.parametrize(
    ("mode", "stream"),
    [("error", True), ("degrade", True), ("degrade", False)],
    ids=["error", "degrade-streamed", "degrade-whole"],
)
async def test_a_first_token_timeout_during_the_prefill_hop_is_the_python_paths(
    mode: str, stream: bool
) -> None:
    """The first-token timeout fires while the prefill hop still runs (a 3,000-token prompt on
    a GPU at 1/20 speed): both paths answer the same bytes (the error, or the notice), the
    prefill instance sees its request end, no decode hop is sent and no hop stays open."""
    body = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "word " * 2400}],
            "max_tokens": 10, "stream": stream}
    streaming = {"first_token_timeout_ms": 300, "on_first_token_timeout": mode}
    replies = {}
    for native in paths():
        trace = io.StringIO()
        async with split_gateway(speed=0.05, native=native, trace=trace, streaming=streaming) as s:
            served_natively, replies[native] = await _exchange(s.harness.url, body)
            assert served_natively == native
            p0, p1 = s.recorders["p0"], s.recorders["p1"]
            (hop,) = p0.headers + p1.headers
            await until(lambda p0=p0, p1=p1: p0.in_flight + p1.in_flight == 0)
            await until(lambda s=s: s.harness.gateway.relay.relay.live == 0)
            assert s.recorders["d0"].raw == []
        assert _fed(trace, hop["x-request-id"]) == ["arrive"]  # the runtime's own timer ended it
    _, python = with_reference([replies[n] for n in paths()], mask=_heads_sorted)
    _same_reply(replies[True], python)
    assert b"first_token_timeout" in replies[True], replies[True]
