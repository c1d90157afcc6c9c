"""The simulated vLLM's routes beyond completions, shaped as vLLM 0.x answers them.

`/v1/responses` (streamed as vLLM's `event:` frames, or whole) generates on the engine model like
a completion. The pooling and utility routes answer at once (after `light_hold_s`, when the
tests need them to take time): `/v1/embeddings` (float or base64 vectors of the model's hidden
size, unit length, deterministic in the text), `/tokenize` and `/detokenize` (`vocab.py`, whose
count is the server's prompt count), `/v1/score`, `/score`, `/rerank`, `/v1/rerank`,
`/v2/rerank` (a deterministic relevance from shared words), and `/v1/audio/transcriptions` and
`/v1/audio/translations` (multipart; the text's length follows the file's). The app counts how
many of these it holds at once (`state["light_peak"]`), so a test can see a cap from outside.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import math
import struct
import time
from typing import TYPE_CHECKING, Any

from fastapi import Request  # noqa: TC002 - FastAPI resolves route signatures at runtime
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmflow.sim import vocab

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from fastapi import FastAPI

    from llmflow.sim.driver import RealtimeEngine, Stream

__all__ = ["install"]

_AUDIO_BYTES_PER_WORD = 4000  # about a quarter second of 16 kHz 16-bit audio per word


def install(
    app: FastAPI,
    names: list[str],
    hidden: int,
    max_model_len: int,
    state: dict[str, Any],
    eos_for: Callable[[bool], int | None],
    text_of: Callable[[int, int, int], str],
    light_hold_s: float = 0.0,
) -> None:
    """Add the routes to the simulated server `app`.

    Args:
        app: the simulated vLLM app (its `state` holds the engine once started).
        names: served model names.
        hidden: embedding width (the model's hidden size).
        max_model_len: the context limit.
        state: the server's shared state (`engine`; `light`/`light_peak` are kept here).
        eos_for: the server's simulated EOS draw.
        text_of: the server's filler text for (request, first token, count).
        light_hold_s: how long each light request is held before its answer (wall seconds).
    """
    state.setdefault("light", 0)
    state.setdefault("light_peak", 0)

    def error(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
        return JSONResponse(
            {"error": {"message": message, "type": kind, "param": None, "code": status}},
            status_code=status,
        )

    async def json_body(request: Request) -> dict[str, Any] | JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            return error(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            return error(400, "request body must be a JSON object")
        model = body.get("model") or names[0]
        if model not in names:
            return error(404, f"The model `{model}` does not exist.", "NotFoundError")
        body["model"] = model
        return body

    async def held(answer: Callable[[], Response]) -> Response:
        state["light"] += 1
        state["light_peak"] = max(state["light_peak"], state["light"])
        try:
            if light_hold_s:
                await asyncio.sleep(light_hold_s)
            return answer()
        finally:
            state["light"] -= 1

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        body = await json_body(request)
        if isinstance(body, Response):
            return body
        try:
            inputs = _texts(body.get("input"))
        except ValueError as exc:
            return error(400, str(exc))
        b64 = body.get("encoding_format") == "base64"
        tokens = sum(len(ids) for _, ids in inputs)

        def answer() -> Response:
            data = []
            for i, (text, _) in enumerate(inputs):
                vector = _vector(text, hidden)
                embedding: Any = (
                    base64.b64encode(struct.pack(f"<{hidden}f", *vector)).decode()
                    if b64
                    else vector
                )
                data.append({"object": "embedding", "index": i, "embedding": embedding})
            return JSONResponse(
                {
                    "id": f"embd-{time.monotonic_ns()}",
                    "object": "list",
                    "created": int(time.time()),
                    "model": body["model"],
                    "data": data,
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                }
            )

        return await held(answer)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await json_body(request)
        if isinstance(body, Response):
            return body
        if isinstance(body.get("prompt"), str):
            ids = vocab.tokenize(body["prompt"])
        elif isinstance(body.get("messages"), list):
            text = "".join(
                str(m.get("content") or "") for m in body["messages"] if isinstance(m, dict)
            )
            ids = vocab.tokenize(text)
        else:
            return error(400, "send `prompt` (a string) or `messages`")
        return await held(
            lambda: JSONResponse(
                {
                    "count": len(ids),
                    "max_model_len": max_model_len,
                    "tokens": ids,
                    "token_strs": None,
                }
            )
        )

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await json_body(request)
        if isinstance(body, Response):
            return body
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            return error(400, "tokens must be a list of token ids")
        try:
            text = vocab.detokenize(ids)
        except ValueError as exc:
            return error(400, str(exc))
        return await held(lambda: JSONResponse({"prompt": text}))

    async def score(request: Request) -> Response:
        body = await json_body(request)
        if isinstance(body, Response):
            return body
        first, second = (
            body.get("text_1", body.get("queries")),
            body.get("text_2", body.get("documents")),
        )
        try:
            queries, documents = _texts(first), _texts(second)
        except ValueError as exc:
            return error(400, f"text_1/text_2: {exc}")
        if len(queries) == 1:
            queries = queries * len(documents)
        if len(queries) != len(documents):
            return error(400, "text_1 must have one entry or as many as text_2")
        data = [
            {"index": i, "object": "score", "score": _relevance(q, d)}
            for i, ((q, _), (d, _)) in enumerate(zip(queries, documents, strict=True))
        ]
        tokens = sum(len(a) + len(b) for (_, a), (_, b) in zip(queries, documents, strict=True))
        return await held(
            lambda: JSONResponse(
                {
                    "id": f"score-{time.monotonic_ns()}",
                    "object": "list",
                    "created": int(time.time()),
                    "model": body["model"],
                    "data": data,
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                }
            )
        )

    async def rerank(request: Request) -> Response:
        body = await json_body(request)
        if isinstance(body, Response):
            return body
        query, documents = body.get("query"), body.get("documents")
        if (
            not isinstance(query, str)
            or not isinstance(documents, list)
            or not all(isinstance(d, str) for d in documents)
        ):
            return error(400, "send `query` (a string) and `documents` (a list of strings)")
        order = sorted(range(len(documents)), key=lambda i: -_relevance(query, documents[i]))
        ranked = [
            {
                "index": i,
                "document": {"text": documents[i]},
                "relevance_score": _relevance(query, documents[i]),
            }
            for i in order
        ]
        top_n = body.get("top_n")
        if isinstance(top_n, int) and top_n > 0:
            ranked = ranked[:top_n]
        tokens = sum(vocab.count(query) + vocab.count(d) for d in documents)
        return await held(
            lambda: JSONResponse(
                {
                    "id": f"rerank-{time.monotonic_ns()}",
                    "model": body["model"],
                    "usage": {"total_tokens": tokens},
                    "results": ranked,
                }
            )
        )

    for path in ("/score", "/v1/score"):
        app.add_api_route(path, score, methods=["POST"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank, methods=["POST"])

    async def audio(request: Request) -> Response:
        fields = _multipart(request.headers.get("content-type", ""), await request.body())
        if fields is None or "file" not in fields:
            return error(400, "send multipart/form-data with a `file` part")
        model = fields.get("model", b"").decode() or names[0]
        if model not in names:
            return error(404, f"The model `{model}` does not exist.", "NotFoundError")
        words = max(1, len(fields["file"]) // _AUDIO_BYTES_PER_WORD)
        return await held(lambda: JSONResponse({"text": text_of(7, 0, words).strip()}))

    for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
        app.add_api_route(path, audio, methods=["POST"])

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        body = await json_body(request)
        if isinstance(body, Response):
            return body
        try:
            prompt = _response_prompt(body)
            max_tokens = int(body.get("max_output_tokens") or max_model_len - prompt)
            engine: RealtimeEngine = state["engine"]
            stream = engine.submit(prompt, max_tokens, eos_for(bool(body.get("ignore_eos"))))
        except (ValueError, TypeError) as exc:
            return error(400, str(exc))
        except Exception as exc:  # the engine's own refusal (context too long, ...)
            return error(400, str(exc))
        meta = {
            "id": f"resp_{stream.seq.rid}",
            "created_at": int(time.time()),
            "model": body["model"],
            "prompt": prompt,
            "max": max_tokens,
        }
        if body.get("stream"):
            return StreamingResponse(
                _events(engine, stream, meta, text_of), media_type="text/event-stream"
            )
        try:
            async for _ in stream:
                pass
        finally:
            engine.abort(stream)
        text = text_of(stream.seq.rid, 0, stream.sent)
        return JSONResponse(_response(meta, "completed", text, stream.sent))


def _texts(value: Any) -> list[tuple[str, list[int]]]:
    """Inputs as (text, token ids): a string, token ids, or a list of either."""
    if isinstance(value, str):
        return [(value, vocab.tokenize(value))]
    if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
        return [(vocab.detokenize(value), list(value))]
    if isinstance(value, list) and value:
        out: list[tuple[str, list[int]]] = []
        for item in value:
            out.extend(_texts(item))
        return out
    raise ValueError("input must be a string, token ids, or a non-empty list of either")


def _vector(text: str, hidden: int) -> list[float]:
    """A unit vector, the same for the same text."""
    seed = hashlib.blake2b(text.encode(), digest_size=8).digest()
    values: list[float] = []
    block = seed
    while len(values) < hidden:
        block = hashlib.blake2b(block, digest_size=64).digest()
        values.extend((b - 127.5) / 127.5 for b in block)
    values = values[:hidden]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [v / norm for v in values]


def _relevance(query: str, document: str) -> float:
    """Shared words over the query's words, in [0, 1]."""
    q = {w.strip(".,!?").lower() for w in query.split()}
    d = {w.strip(".,!?").lower() for w in document.split()}
    return round(len(q & d) / len(q), 6) if q else 0.0


def _multipart(content_type: str, raw: bytes) -> dict[str, bytes] | None:
    """The named parts of a multipart/form-data body (enough for the audio routes)."""
    if not content_type.startswith("multipart/form-data") or "boundary=" not in content_type:
        return None
    boundary = content_type.split("boundary=", 1)[1].split(";", 1)[0].strip('"').encode()
    fields: dict[str, bytes] = {}
    for part in raw.split(b"--" + boundary)[1:]:
        head, _, value = part.partition(b"\r\n\r\n")
        marker = b'name="'
        at = head.find(marker)
        if at < 0:
            continue
        name = head[at + len(marker) : head.index(b'"', at + len(marker))].decode()
        fields[name] = value.removesuffix(b"\r\n")
    return fields


def _response_prompt(body: dict[str, Any]) -> int:
    total = vocab.count(body["instructions"]) if isinstance(body.get("instructions"), str) else 0
    source = body.get("input")
    if isinstance(source, str):
        return total + vocab.count(source)
    if not isinstance(source, list) or not source:
        raise ValueError("input must be a string or a non-empty list of items")
    for item in source:
        content = item.get("content") if isinstance(item, dict) else None
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        total += 4 + (vocab.count(content) if isinstance(content, str) and content else 0)
    return total


def _response(meta: dict[str, Any], status: str, text: str, tokens: int) -> dict[str, Any]:
    done = status == "completed"
    message = {
        "id": f"msg_{meta['id']}",
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": None}],
    }
    return {
        "id": meta["id"],
        "object": "response",
        "created_at": meta["created_at"],
        "model": meta["model"],
        "status": status,
        "output": [message] if text or done else [],
        "max_output_tokens": meta["max"],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "temperature": 1.0,
        "top_p": 1.0,
        "incomplete_details": None,
        "error": None,
        "instructions": None,
        "metadata": None,
        "usage": {
            "input_tokens": meta["prompt"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": meta["prompt"] + tokens,
        }
        if done
        else None,
    }


async def _events(
    engine: RealtimeEngine,
    stream: Stream,
    meta: dict[str, Any],
    text_of: Callable[[int, int, int], str],
) -> AsyncIterator[str]:
    seq = 0

    def frame(kind: str, **fields: Any) -> str:
        nonlocal seq
        seq += 1
        data = {"type": kind, "sequence_number": seq - 1, **fields}
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    rid, item = stream.seq.rid, f"msg_{meta['id']}"
    place = {"item_id": item, "output_index": 0, "content_index": 0}
    try:
        yield frame("response.created", response=_response(meta, "in_progress", "", 0))
        yield frame("response.in_progress", response=_response(meta, "in_progress", "", 0))
        yield frame(
            "response.output_item.added",
            output_index=0,
            item={
                "id": item,
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            },
        )
        yield frame(
            "response.content_part.added",
            **place,
            part={"type": "output_text", "text": "", "annotations": []},
        )
        async for n in stream:
            for i in range(stream.sent - n, stream.sent):  # one event per token, as vLLM
                yield frame(
                    "response.output_text.delta", **place, delta=text_of(rid, i, 1), logprobs=[]
                )
        text = text_of(rid, 0, stream.sent)
        yield frame("response.output_text.done", **place, text=text, logprobs=[])
        yield frame(
            "response.content_part.done",
            **place,
            part={"type": "output_text", "text": text, "annotations": []},
        )
        final = _response(meta, "completed", text, stream.sent)
        yield frame("response.output_item.done", output_index=0, item=final["output"][0])
        yield frame("response.completed", response=final)
    finally:
        engine.abort(stream)  # no-op when it already finished; aborts on a disconnect
