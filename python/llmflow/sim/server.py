"""A simulated vLLM server: the engine model in real time behind vLLM's OpenAI HTTP surface.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (streaming as SSE or not;
`max_tokens`, `ignore_eos`, `priority`, `stream_options.include_usage`), `GET /v1/models`,
`GET /health`, `GET /metrics` (vLLM's metric names), and in `server_routes.py` the Responses
API, embeddings, tokenize/detokenize, score/rerank and audio. A client that disconnects aborts
its request, queued or running, as vLLM does. This is the embedded backend the gateway starts
when a backend has no URL, and what fast tests run against.

Prompt tokens are counted with the simulated tokenizer (`vocab.py`, `estimate_tokens`): one
token per 4 ASCII characters of a run (rounded up) plus one per other character (CJK text is
about one token per character), plus 4 per chat message for the template. A token-id list
counts its length. Unless `ignore_eos` is set, the answer ends at a simulated EOS drawn
deterministically from the seed and the request number (lognormal, median 200 tokens), capped
by `max_tokens`. Generated text is filler words.

With `kv_transfer` set it also plays either side of vLLM's prefill/decode hand-off (the NIXL
connector's `kv_transfer_params`, a side channel at `/_sim/kv/*`; see `server_pd.py`). Without
it, `kv_transfer_params` is ignored and answered `null`, as vLLM without a KV connector does.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from llmflow.presets import model as model_preset
from llmflow.sim import server_routes, vocab
from llmflow.sim.costmodel import cost_model
from llmflow.sim.driver import RealtimeEngine, Stream
from llmflow.sim.engine import EngineConfig, EngineCore, EngineError
from llmflow.sim.server_pd import KvConnector, KvTransfer
from llmflow.sim.servermetrics import render_metrics

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from llmflow.sim.engine import Seq

__all__ = ["KvTransfer", "create_app", "estimate_tokens", "parse_preset"]

_WORDS = ("the", "flow", "of", "tokens", "keeps", "moving", "while", "queues", "stay", "short",
          "and", "every", "request", "gets", "its", "turn", "in", "time", "with", "care")
_EOS_MEDIAN = 200.0  # tokens, median simulated answer length without ignore_eos
_EOS_SIGMA = 0.8


def estimate_tokens(text: str) -> int:
    """Deterministic token count, at least 1: `/tokenize`'s ids (`vocab.py`) for the same text,
    one per 4 ASCII characters of a run (rounded up) plus one per other character."""
    return vocab.count(text)


def parse_preset(preset: str) -> tuple[str, str, int]:
    """`"h100:llama-3-8b[:tp]"` -> (gpu, model, tp).

    Raises:
        ValueError: not of that shape.
    """
    parts = preset.split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(f"preset must look like GPU:MODEL[:TP] (e.g. h100:llama-3-8b), got "
                         f"{preset!r}")
    return parts[0], parts[1], int(parts[2]) if len(parts) == 3 else 1


def _error(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                   "code": status}}, status_code=status)


def _chat_prompt(messages: Any) -> int:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    total = 2
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        total += 4 + (estimate_tokens(content) if isinstance(content, str) and content else 0)
    return total


def _block_hashes(body: dict[str, Any], chat: bool, block_size: int) -> tuple[int, ...]:
    """The prompt's block hashes for the engine's prefix cache: chained, one per full block of
    `block_size` tokens at this server's 4 characters a token, over the prompt as a chat
    template lays it out (so a resent history shares its leading blocks, as in vLLM). An
    approximation of vLLM's token blocks, on its own hash, independent of the gateway's."""
    if chat:
        parts = []
        for m in body.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            role = m.get("role", "") if isinstance(m, dict) else ""
            parts.append(f"<|{role}|>\n{content if isinstance(content, str) else ''}\n")
        text = "".join(parts)
    else:
        prompt = body.get("prompt")
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
    data, chunk = text.encode("utf-8"), 4 * block_size
    out, parent = [], b""
    for start in range(0, len(data) - chunk + 1, chunk):
        parent = hashlib.blake2b(parent + data[start:start + chunk], digest_size=8).digest()
        out.append(int.from_bytes(parent, "little") >> 1)
    return tuple(out)


def _completion_prompt(prompt: Any) -> int:
    if isinstance(prompt, str):
        return estimate_tokens(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list) and len(prompt) == 1:
        return _completion_prompt(prompt[0])
    raise ValueError("prompt must be a string or one list of token ids (n=1 only)")


def create_app(
    preset: str = "h100:llama-3-8b",
    speed: float = 1.0,
    model: str | None = None,
    models: list[str] | None = None,
    max_model_len: int = 8192,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    num_gpu_blocks: int | None = None,
    scheduling_policy: str = "fcfs",
    gpus: int | None = None,
    seed: int = 0,
    light_hold_s: float = 0.0,
    kv_transfer: KvTransfer | None = None,
) -> FastAPI:
    """Build the simulated vLLM app; its lifespan starts and stops the real-time engine.

    Args:
        preset: `GPU:MODEL[:TP]` to imitate (GPUs: a100-80g, h100, h200, l40s).
        speed: simulated seconds per wall second (2 = twice as fast as the GPU).
        model: served model name (default: the preset's model name).
        models: served model names (the first is the default); overrides `model`.
        max_model_len: context limit in tokens; longer requests get 400.
        max_num_seqs: vLLM's running-batch limit.
        max_num_batched_tokens: vLLM's per-step token budget.
        num_gpu_blocks: KV capacity in 16-token blocks (default: from GPU memory).
        scheduling_policy: "fcfs", or "priority" to honour the request's `priority`.
        gpus: tensor-parallel degree, when not given in the preset.
        seed: seeds the simulated EOS lengths.
        light_hold_s: how long each embeddings/score/rerank/tokenize/audio request takes.
        kv_transfer: act as vLLM with a NIXL KV connector (P/D disaggregation) over this link.

    Raises:
        KeyError: an unknown GPU or model preset.
        ValueError: a bad preset string or inconsistent flags.
    """
    gpu_name, model_name, tp = parse_preset(preset)
    tp = gpus or tp
    names = list(models or [model or model_name])
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=max_model_len, num_gpu_blocks=num_gpu_blocks,
                          scheduling_policy=scheduling_policy)  # type: ignore[arg-type]
    core = EngineCore(config, cost_model(gpu_name, model_name, tp))
    state: dict[str, Any] = {"engine": None, "n": 0}
    kv = KvConnector(kv_transfer, state, tp) if kv_transfer is not None else None

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        engine = RealtimeEngine(core, speed)
        state["engine"] = engine
        if kv is not None:
            kv.start(engine)
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()
            if kv is not None:
                await kv.close()  # after the engine's aborts, which may start notifications

    app = FastAPI(title="llmflow simulated vLLM", lifespan=lifespan)
    app.state.sim = state

    def eos_for(ignore_eos: bool) -> int | None:
        state["n"] += 1
        if ignore_eos:
            return None
        rng = random.Random(seed * 1_000_003 + state["n"])
        return max(1, round(rng.lognormvariate(math.log(_EOS_MEDIAN), _EOS_SIGMA)))

    async def serve(request: Request, chat: bool) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        name = body.get("model") or names[0]
        if name not in names:
            return _error(404, f"The model `{name}` does not exist.", "NotFoundError")
        try:
            prompt = _chat_prompt(body.get("messages")) if chat else _completion_prompt(
                body.get("prompt"))
            default = max_model_len - prompt if chat else 16
            max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens")
                             or default)
            priority = int(body.get("priority") or 0)
            engine: RealtimeEngine = state["engine"]
            hashes = _block_hashes(body, chat, engine.core.block_size)
            hold, remote = kv.parse(body) if kv is not None else (False, None)
            stream = engine.submit(prompt, max_tokens, eos_for(bool(body.get("ignore_eos"))),
                                   priority if scheduling_policy == "priority" else 0,
                                   hash_ids=hashes or None, hold_kv=hold,
                                   remote_kv=remote is not None)
            if kv is not None and remote is not None:
                kv.expect(stream.seq, remote)
        except (ValueError, TypeError, EngineError) as exc:
            return _error(400, str(exc))
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{stream.seq.rid}", "created":
                int(time.time()), "model": name, "prompt": prompt, "chat": chat}
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(_sse(engine, stream, meta, usage),
                                     media_type="text/event-stream")
        params = (lambda seq: kv.answer(seq, request)) if kv is not None else None
        return await _whole(engine, stream, meta, request, params)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, chat=True)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": n, "object": "model", "created": 0, "owned_by": "vllm", "root": n,
             "parent": None, "max_model_len": max_model_len} for n in names]}

    if kv is not None:
        kv.install(app)
    server_routes.install(app, names, model_preset(model_name).hidden, max_model_len, state,
                          eos_for, _text, light_hold_s)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = render_metrics(state["engine"], names[0])
        if kv is not None and state["engine"] is not None:
            text += kv.render(f'engine="0",model_name="{names[0]}"')
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _text(rid: int, start: int, n: int) -> str:
    return "".join(" " + _WORDS[(rid * 7 + i) % len(_WORDS)] for i in range(start, start + n))


def _usage(meta: dict[str, Any], tokens: int) -> dict[str, int]:
    return {"prompt_tokens": meta["prompt"], "completion_tokens": tokens,
            "total_tokens": meta["prompt"] + tokens}


def _choice(meta: dict[str, Any], text: str, finish: str | None, delta: bool) -> dict[str, Any]:
    if not meta["chat"]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                "stop_reason": None}
    key = "delta" if delta else "message"
    return {"index": 0, key: {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish, "stop_reason": None}


def _envelope(meta: dict[str, Any], chunk: bool) -> dict[str, Any]:
    kind = ("chat.completion" if meta["chat"] else "text_completion") + (
        ".chunk" if chunk and meta["chat"] else "")
    return {"id": meta["id"], "object": kind, "created": meta["created"], "model": meta["model"]}


async def _sse(engine: RealtimeEngine, stream: Stream, meta: dict[str, Any], usage: bool,
               ) -> AsyncIterator[str]:
    rid = stream.seq.rid
    try:
        async for n in stream:
            text = _text(rid, stream.sent - n, n)
            body = {**_envelope(meta, True), "choices": [_choice(meta, text, None, True)]}
            yield f"data: {json.dumps(body)}\n\n"
        finish = "length" if stream.finish_reason == "length" else "stop"
        body = {**_envelope(meta, True), "choices": [_choice(meta, "", finish, True)]}
        yield f"data: {json.dumps(body)}\n\n"
        if usage:
            tail = {**_envelope(meta, True), "choices": [], "usage": _usage(meta, stream.sent)}
            yield f"data: {json.dumps(tail)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        engine.abort(stream)  # no-op when it already finished; aborts on a disconnect


async def _whole(engine: RealtimeEngine, stream: Stream, meta: dict[str, Any], request: Request,
                 kv_params: Callable[[Seq], dict[str, Any] | None] | None = None) -> Response:
    async def consume() -> None:
        async for _ in stream:
            pass

    task = asyncio.create_task(consume())
    try:
        while not task.done():
            await asyncio.wait([task], timeout=0.1)
            if not task.done() and await request.is_disconnected():
                engine.abort(stream)
                return Response(status_code=499)
    finally:
        if not task.done():
            task.cancel()
    finish = "length" if stream.finish_reason == "length" else "stop"
    text = _text(stream.seq.rid, 0, stream.sent)
    return JSONResponse({**_envelope(meta, False), "choices": [_choice(meta, text, finish, False)],
                         "usage": _usage(meta, stream.sent),
                         "kv_transfer_params": kv_params(stream.seq) if kv_params else None})
