"""A fake vLLM OpenAI server for gateway tests: exact timing and injected faults.

Each request may carry a `fake` object (the gateway passes unknown fields through, and the
`openai` client sends it with `extra_body`) that scripts the reply:

- `tokens` (int): how many tokens to generate (default: `max_tokens`, else 8);
- `ttft` / `itl` (seconds): delay before the first token / between tokens;
- `status` (int): answer this HTTP error status instead of streaming;
- `crash_after` (int): drop the connection after that many tokens;
- `hang` (bool): accept the request and never send a byte;
- `step` (bool): emit each token only when the test calls `FakeVllm.release()`;
- `chunk_bytes` (int): pad each token's text to this many bytes (to fill socket buffers);
- `malformed_after` (int): after that many tokens send a `data:` frame that is not JSON;
- `error_after` (int): after that many tokens send vLLM's in-band error event (a 500 in the
  middle of a stream: `data: {"error": {..., "code": 500}}`, then `[DONE]`), as vLLM does
  when the engine fails under a started stream; with `error_param` (str) the event is vLLM's
  refusal of a parameter instead (`"code": 400`, that `param`), as vLLM sends one it checks
  only once the stream has begun (`logprobs` over its maximum);
- `close_after` (int): after that many tokens end the body cleanly, without `[DONE]`;
- `choice_tokens` (list of int): with several choices, how many tokens each generates (a
  choice that finishes early sends its finishing chunk while the others go on);
- `hold_done` (bool): with `step`, every choice finished, hold the usage chunk and `[DONE]`
  until one more `release()` (a reply whose choices all ended, its stream still open).

A request for several choices (`n`, times the prompts of a completions `prompt` list, indexed
`prompt * n + choice` as vLLM does) streams one chunk per choice per step, interleaved, each
with the usage so far over all choices when continuous usage is asked; a `step` reply emits
one step (a token of every unfinished choice) per `release()`.

A request without `"stream": true` gets one JSON answer (`fake_whole: true` in it), as vLLM
answers what the gateway sends unstreamed.

`/v1/responses` speaks vLLM's Responses events (`event: <type>` and `data:` lines, no
`[DONE]`): `response.created`, `response.in_progress`, the output item and part added, one
`response.output_text.delta` per token (up to `max_output_tokens`), the text and part and item
done, then `response.completed` with the usage. `tokens`, `ttft`, `itl`, `step`, `status`,
`hang`, `crash_after` and `chunk_bytes` script it as above; `error_after` sends vLLM's `error`
event instead of a token, and `fail_after` a `response.failed` one.

`/metrics` misbehaves on request too: `metrics_status` (answer that status), `metrics_delay`
(seconds before answering), `metrics_garbage` (answer 200 with text that is not vLLM's).

It speaks vLLM's streaming format: a role chunk first, one chunk per token with continuous usage
when asked, a usage-only chunk when `include_usage` is set, then `data: [DONE]`. It counts what a
test needs to check: requests seen, running now, aborted by the client, completed, peak running
(requests a client held open at once, read from the sockets: a request whose client has closed
its connection does not count against the next one, even before this loop has noticed), and
the bodies it received.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route, Router

if TYPE_CHECKING:
    from starlette.requests import Request

__all__ = ["FakeVllm"]


@dataclass(repr=False)
class FakeVllm:
    """The fake server's state and its ASGI app (`.app`)."""

    model: str = "fake-model"
    kv_usage: float = 0.0
    preemptions: int = 0
    metrics_status: int = 200
    metrics_delay: float = 0.0
    metrics_garbage: bool = False
    kv_name: str = "vllm:kv_cache_usage_perc"
    num_gpu_blocks: int = 1000
    default: dict[str, Any] = field(default_factory=dict)
    seen: int = 0
    running: int = 0
    peak_running: int = 0
    aborted: int = 0
    completed: int = 0
    broken: int = 0  # replies the fake itself broke off (error event, early close)
    tokens_sent: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)  # each request's, lower-case
    metrics_scrapes: int = 0

    def __repr__(self) -> str:
        return f"FakeVllm(seen={self.seen}, running={self.running}, aborted={self.aborted})"

    def __post_init__(self) -> None:
        self._steps: asyncio.Queue[None] | None = None
        self._held: list[_HeldBy] = []
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._complete, methods=["POST"]),
                Route("/v1/completions", self._complete, methods=["POST"]),
                Route("/v1/models", self._models),
                Route("/health", self._health),
                Route("/metrics", self._metrics),
            ]
        )
        # Responses on the router's fallback: a test that mounts its own `/v1/responses` (a
        # route appended to the app's) answers in its place.
        self.app.router.default = Router([Route("/v1/responses", self._complete, methods=["POST"])])

    @property
    def steps(self) -> asyncio.Queue[None]:
        """Permits for `step` replies (created on the running loop)."""
        if self._steps is None:
            self._steps = asyncio.Queue()
        return self._steps

    def release(self, n: int = 1) -> None:
        """Let `step` replies emit `n` more tokens."""
        for _ in range(n):
            self.steps.put_nowait(None)

    async def _health(self, _request: Request) -> Response:
        return Response(status_code=200)

    async def _models(self, _request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _metrics(self, _request: Request) -> Response:
        self.metrics_scrapes += 1
        if self.metrics_delay:
            await asyncio.sleep(self.metrics_delay)
        if self.metrics_garbage:
            return PlainTextResponse("<html>\x00\xff not metrics {{{\nvllm: nan nan\n")
        if self.metrics_status != 200:
            return PlainTextResponse("boom", status_code=self.metrics_status)
        labels = f'engine="0",model_name="{self.model}"'
        text = "\n".join(
            [
                "# HELP vllm:num_requests_running Number of requests in model execution batches.",
                "# TYPE vllm:num_requests_running gauge",
                f"vllm:num_requests_running{{{labels}}} {float(self.running)}",
                f"vllm:num_requests_waiting{{{labels}}} 0.0",
                f"{self.kv_name}{{{labels}}} {self.kv_usage}",
                f"vllm:num_preemptions_total{{{labels}}} {float(self.preemptions)}",
                f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{self.num_gpu_blocks}",'
                f'engine="0"}} 1.0',
                "",
            ]
        )
        return PlainTextResponse(text)

    async def _complete(self, request: Request) -> Response:
        held = _HeldBy(request, [h for h in self._held if h.held()])  # as it arrives
        body = await request.json()
        self.seen += 1
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        plan = {**self.default, **(body.get("fake") or {})}
        if plan.get("status"):
            return JSONResponse(
                {
                    "error": {
                        "message": "injected failure",
                        "type": "server_error",
                        "code": plan["status"],
                    }
                },
                status_code=plan["status"],
            )
        if plan.get("hang"):
            return StreamingResponse(self._hang(held), media_type="text/event-stream")
        if request.url.path == "/v1/responses":
            return StreamingResponse(
                self._responses(body, plan, held), media_type="text/event-stream"
            )
        chat = request.url.path.endswith("chat/completions")
        if not body.get("stream"):  # what the gateway sends unstreamed (prompt logprobs)
            return JSONResponse(await self._whole(body, plan, chat, held))
        return StreamingResponse(
            self._stream(body, plan, chat, held), media_type="text/event-stream"
        )

    async def _whole(
        self, body: dict[str, Any], plan: dict[str, Any], chat: bool, held: _HeldBy
    ) -> dict[str, Any]:
        n = int(body.get("max_tokens") or 8)
        text = "".join(f"t{i} " for i in range(n))
        self._enter(held)
        finished = False
        try:  # it runs as long as its stream would (`ttft`, then `itl` per token)
            await asyncio.sleep(float(plan.get("ttft", 0.0)) + float(plan.get("itl", 0.0)) * n)
            finished = True
        finally:
            self._leave(held, finished)
        self.tokens_sent += n
        return {
            "id": f"cmpl-fake{self.seen}",
            "object": "chat.completion" if chat else "text_completion",
            "model": body.get("model", self.model),
            "choices": [{"index": 0, "text": text, "prompt_logprobs": [None, {"7": -1.5}]}],
            "usage": _usage(10, n),
            "fake_whole": True,  # a field only this answer has: it must reach the client
        }

    async def _hang(self, held: _HeldBy) -> Any:
        self._enter(held)
        finished = False
        try:
            await asyncio.Event().wait()
            finished = True
            yield b""
        finally:
            self._leave(held, finished)

    def _enter(self, held: _HeldBy) -> None:
        self.running += 1
        # Peak running counts the requests the client held open when this one arrived (or
        # holds now): one whose connection was already closed is vLLM's to abort, even before
        # this loop has got round to noticing (vLLM's API server notices it first, and adds a
        # new request to the engine only after tokenizing it).
        alongside = sum(h in held.before or h.held() for h in self._held)
        self._held.append(held)
        self.peak_running = max(self.peak_running, 1 + alongside)

    def _leave(self, held: _HeldBy, finished: bool | None) -> None:
        self.running -= 1
        self._held.remove(held)
        if finished is None:
            self.broken += 1
        elif finished:
            self.completed += 1
        else:
            self.aborted += 1

    async def _stream(
        self, body: dict[str, Any], plan: dict[str, Any], chat: bool, held: _HeldBy
    ) -> Any:
        self._enter(held)
        finished: bool | None = False
        try:
            n = int(plan.get("tokens") or body.get("max_tokens") or 8)
            options = body.get("stream_options") or {}
            base = {
                "id": f"{'chatcmpl' if chat else 'cmpl'}-fake{self.seen}",
                "created": int(time.time()),
                "model": body.get("model", self.model),
                "object": "chat.completion.chunk" if chat else "text_completion",
            }
            continuous = bool(options.get("continuous_usage_stats"))
            prompt = 10
            await asyncio.sleep(float(plan.get("ttft", 0.0)))
            counts = [int(c) for c in plan.get("choice_tokens") or [n] * _choices(body, chat)]
            if chat:
                for index in range(len(counts)):
                    role = {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    yield _frame(base, [role], _usage(prompt, 0) if continuous else None)
            sent = 0
            for i in range(max(counts, default=0)):
                await self._pace(plan, i)
                if _due(plan, "malformed_after", i):
                    yield b'data: {"id": "broken", "choices": [{"delta": \n\n'
                    await asyncio.Event().wait()  # the gateway must not wait for more
                if _due(plan, "error_after", i):
                    error = _ENGINE_ERROR
                    if plan.get("error_param"):
                        error = _refusal(str(plan["error_param"]))
                    yield b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
                    yield b"data: [DONE]\n\n"
                    finished = None
                    return
                if _due(plan, "close_after", i):
                    finished = None
                    return
                text = _token(plan, i)
                for index, count in enumerate(counts):
                    if i >= count:
                        continue
                    finish = "length" if i == count - 1 else None
                    choice: dict[str, Any] = (
                        {"index": index, "delta": {"content": text}}
                        if chat
                        else {"index": index, "text": text}
                    )
                    choice.update(logprobs=None, finish_reason=finish)
                    self.tokens_sent += 1
                    sent += 1
                    yield _frame(base, [choice], _usage(prompt, sent) if continuous else None)
            n = sent
            if plan.get("step") and plan.get("hold_done"):
                await self.steps.get()
            if options.get("include_usage"):
                yield _frame(base, [], _usage(prompt, n))
            yield b"data: [DONE]\n\n"
            finished = True
        finally:
            self._leave(held, finished)

    async def _pace(self, plan: dict[str, Any], i: int) -> None:
        """Wait for step `i` of a reply as its plan says (a permit, the inter-token latency, or
        just a checkpoint), and crash there if it says so."""
        if plan.get("step"):
            await self.steps.get()
        elif i and plan.get("itl"):
            await asyncio.sleep(float(plan["itl"]))
        else:  # a checkpoint, so a client's disconnect cancels us as it does vLLM
            await asyncio.sleep(0)
        if _due(plan, "crash_after", i):
            raise ConnectionAbortedError("injected crash mid-stream")

    async def _responses(self, body: dict[str, Any], plan: dict[str, Any], held: _HeldBy) -> Any:
        self._enter(held)
        finished: bool | None = False
        seq = 0

        def event(kind: str, **fields: Any) -> bytes:
            nonlocal seq
            seq += 1
            data = json.dumps({"type": kind, "sequence_number": seq - 1, **fields})
            return f"event: {kind}\ndata: {data}\n\n".encode()  # as vLLM frames them

        rid, item = f"resp_fake{self.seen}", f"msg_fake{self.seen}"
        place = {"item_id": item, "output_index": 0, "content_index": 0}
        created = int(time.time())

        def response(status: str, text: str, tokens: int) -> dict[str, Any]:
            done = status == "completed"
            message = {
                "id": item,
                "type": "message",
                "role": "assistant",
                "status": status,
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
            usage = {"input_tokens": 10, "output_tokens": tokens, "total_tokens": 10 + tokens}
            return {
                "id": rid,
                "object": "response",
                "created_at": created,
                "model": body.get("model", self.model),
                "status": status,
                "output": [message] if done else [],
                "max_output_tokens": body.get("max_output_tokens"),
                "usage": usage if done else None,
            }

        try:
            n = int(plan.get("tokens") or body.get("max_output_tokens") or 8)
            await asyncio.sleep(float(plan.get("ttft", 0.0)))
            yield event("response.created", response=response("in_progress", "", 0))
            yield event("response.in_progress", response=response("in_progress", "", 0))
            yield event(
                "response.output_item.added",
                output_index=0,
                item={**response("completed", "", 0)["output"][0], "status": "in_progress"},
            )
            yield event(
                "response.content_part.added",
                **place,
                part={"type": "output_text", "text": "", "annotations": []},
            )
            text = ""
            for i in range(n):
                await self._pace(plan, i)
                if _due(plan, "error_after", i):
                    yield event("error", code="server_error", message="injected", param=None)
                    finished = None
                    return
                if _due(plan, "fail_after", i):
                    failed = {**response("failed", text, i), "error": {"message": "died"}}
                    yield event("response.failed", response=failed)
                    finished = None
                    return
                self.tokens_sent += 1
                delta = _token(plan, i)
                text += delta
                yield event("response.output_text.delta", **place, delta=delta, logprobs=[])
            yield event("response.output_text.done", **place, text=text, logprobs=[])
            final = response("completed", text, n)
            yield event("response.output_item.done", output_index=0, item=final["output"][0])
            yield event("response.completed", response=final)
            finished = True
        finally:
            self._leave(held, finished)


class _HeldBy:
    """Whether a request's client still holds its connection open, as the kernel sees it now
    (the client's FIN or reset has arrived, whether or not this server's loop has read it), and
    which other requests were held open when it arrived (`before`)."""

    def __init__(self, request: Request, before: list[_HeldBy]) -> None:
        self.before = before
        cycle = getattr(request.receive, "__self__", None)  # uvicorn's request cycle
        self._transport = getattr(cycle, "transport", None)
        self._fd = -1
        if self._transport is not None:
            self._fd = self._transport.get_extra_info("socket").fileno()

    def held(self) -> bool:
        if self._transport is None:
            return True
        if self._transport.is_closing():
            return False
        with socket.socket(fileno=os.dup(self._fd)) as sock:
            try:
                return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
            except BlockingIOError:
                return True  # open, nothing pipelined
            except OSError:
                return False  # reset


_ENGINE_ERROR = {
    "object": "error",
    "message": "EngineCore encountered an issue (injected)",
    "type": "InternalServerError",
    "param": None,
    "code": 500,
}


def _refusal(param: str) -> dict[str, Any]:
    return {
        "message": f"{param} is over the maximum (parameter={param})",
        "type": "BadRequestError",
        "param": param,
        "code": 400,
    }


def _choices(body: dict[str, Any], chat: bool) -> int:
    """The choices of a request: `n`, times the prompts of a completions batch."""
    prompt = body.get("prompt")
    batch = not chat and isinstance(prompt, list) and bool(prompt)
    prompts = len(prompt) if batch and not isinstance(prompt[0], int) else 1
    return int(body.get("n") or 1) * prompts


def _token(plan: dict[str, Any], i: int) -> str:
    """Step `i`'s text, padded to the plan's `chunk_bytes`."""
    pad = int(plan.get("chunk_bytes", 0))
    return f"t{i} ".ljust(pad, "x") if pad else f"t{i} "


def _due(plan: dict[str, Any], key: str, i: int) -> bool:
    return plan.get(key) is not None and i >= int(plan[key])


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _frame(
    base: dict[str, Any], choices: list[dict[str, Any]], usage: dict[str, int] | None
) -> bytes:
    chunk = {**base, "choices": choices}
    if usage is not None:
        chunk["usage"] = usage
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"  # as vLLM
