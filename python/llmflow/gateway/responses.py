"""`POST /v1/responses`: the Responses API, governed like completions.

A response generates tokens, so it takes the same path as a completion: the runtime admits,
queues or refuses it by the caller's tenant and tier, starts it on a backend, hears its tokens
and its end, and cuts it on a deadline or a stalled client. Only the shapes differ, and this
module holds them: the prompt estimate from `input` and `instructions`, the output bound
`max_output_tokens`, and vLLM's event stream (`event: response.output_text.delta` and its
kin). Upstream is always streamed, so the runtime hears each token; a client that asked for no
stream gets the final `response` object of the `response.completed` event.

Tokens are counted one per `*.delta` event (text, reasoning, tool-call arguments: vLLM sends one
per engine step), and the final `usage.output_tokens` settles the count when it says more.
Events pass to the client as vLLM framed them (`event:` and `data:` lines), untouched.

This is the Python path's, which serves only what the native front passes to the app (a body
its checks are unsure of, a body sent chunked or compressed, a keyless gateway's request with
an Origin or a foreign Host). The native front serves the rest with the same bytes on the wire:
`rust/src/front/responses.rs` (these checks, the upstream body, the whole and partial replies,
a cut's `error` event) and
`rust/src/relay/responses.rs` (this parser's reading of the events, a reply kind of the relay);
`tests/gateway/test_front_responses.py` holds the two paths against each other.
"""

from __future__ import annotations

import copy
import json
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from llmflow.gateway.errors import GatewayError
from llmflow.gateway.protocol import ResponsesRequest, decode_json
from llmflow.gateway.session import Prepared, StreamSession, body_fingerprint
from llmflow.gateway.sse import SessionStream
from llmflow.gateway.streaming import ClientOptions, notice_for
from llmflow.gateway.tokens import text_tokens

if TYPE_CHECKING:
    from llmflow.gateway.auth import Identity
    from llmflow.gateway.streaming import Item
    from llmflow.gateway.types import Json, Send

__all__ = [
    "ResponsesParser",
    "ResponsesSession",
    "ResponsesStream",
    "prepare_response",
]

PATH = "/v1/responses"
_PER_ITEM = 4  # role markers a chat template adds around each input message
_FINAL = ("response.completed", "response.incomplete")
# The core sets priority; KV transfer is the gateway's; a background reply is not governed.
_STRIPPED = ("priority", "kv_transfer_params", "background")


def prepare_response(
    identity: Identity,
    raw: bytes,
    models: dict[str, int],
    bytes_per_token: float,
    max_tokens_cap: int | None,
    streaming: bool,
    aliases: dict[str, str] | None = None,
) -> Prepared:
    """Check a Responses request completely, without touching a backend.

    `aliases` (`models` in the config): an alias is resolved to the served model it names,
    for the pool it routes to and the body vLLM gets, as for a completion.

    Raises:
        GatewayError: 400 (bad JSON or types, a limit passed, too long for the context),
            404 (unknown model).
    """
    body = decode_json(raw)
    try:
        request = ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise GatewayError(
            400, f"{param}: {first['msg']}", "invalid_request", param=param
        ) from None
    if request.stream and not streaming:
        raise GatewayError(
            400,
            "streaming is disabled on this gateway (streaming.enabled)",
            "streaming_disabled",
            param="stream",
        )
    context = models.get(request.model)
    if context is None:
        raise GatewayError(
            404, f"The model `{request.model}` does not exist.", "model_not_found", param="model"
        )
    prompt = _input_tokens(request, bytes_per_token)
    wanted = request.max_output_tokens
    if max_tokens_cap is not None and wanted is not None and wanted > max_tokens_cap:
        raise GatewayError(
            400,
            f"max_output_tokens is {wanted}, over this gateway's limit of {max_tokens_cap} "
            f"(limits.max_tokens): ask for at most {max_tokens_cap}",
            "max_tokens_too_large",
            param="max_output_tokens",
        )
    if prompt >= context or prompt + (wanted or 0) > context:
        raise GatewayError(
            400,
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt + (wanted or 0)} tokens ({prompt} in the input, {wanted or 0} in the "
            "output). Please reduce the length of the input or max_output_tokens.",
            "context_length_exceeded",
            param="input",
        )
    generated = wanted if wanted is not None else context - prompt
    if max_tokens_cap is not None:
        generated = min(generated, max_tokens_cap)
    served = (aliases or {}).get(request.model, request.model)
    upstream = {k: v for k, v in body.items() if k not in _STRIPPED}
    upstream["model"] = served
    upstream["stream"] = True
    upstream["max_output_tokens"] = generated  # the bound the core planned with holds upstream
    # Forced off, not left to vLLM's default: a stored reply outlives the request, holds a
    # tenant's text on the backend, and is readable by whoever asks for its id.
    upstream["store"] = False
    options = ClientOptions("responses", request.model, bool(request.stream))
    return Prepared(options, identity.tenant, identity.tier, PATH, upstream, prompt, generated,
                    served, fingerprint=body_fingerprint(raw))


def _input_tokens(request: ResponsesRequest, bytes_per_token: float) -> int:
    total = text_tokens(request.instructions, bytes_per_token) if request.instructions else 0
    if isinstance(request.input, str):
        return total + text_tokens(request.input, bytes_per_token)
    for item in request.input:
        total += _PER_ITEM
        content = item.get("content")
        if isinstance(content, str):
            total += text_tokens(content, bytes_per_token)
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                if isinstance(text, str):
                    total += text_tokens(text, bytes_per_token)
    return max(total, 1)


class ResponsesParser:
    """Reads vLLM's Responses events: counts tokens, keeps the reply, frames events for SSE.

    The attributes mirror `ChunkParser`'s, which the session and the metrics read.
    """

    def __init__(self, options: ClientOptions) -> None:
        self.options = options
        self.completion_tokens = 0
        self.usage: Json | None = None
        self.template: Json | None = None
        self.finished: set[int] = set()
        self.response: Json | None = None  # the latest full response object seen
        self.text: list[str] = []  # output text so far (for a cut non-streaming reply)

    def take_held(self, *, every: bool = False) -> list[Json]:
        """Nothing is held: Responses events go on as they come (`ChunkParser.take_held`)."""
        return []

    def feed(self, data: bytes) -> tuple[Item | None, int]:
        """Read one `data:` payload: (its SSE frame, or an `{"error"}` item; new tokens)."""
        event: Any = json.loads(data)
        if not isinstance(event, dict):
            return None, 0
        kind = str(event.get("type", ""))
        if kind in ("error", "response.failed"):
            return {"error": _error_of(event)}, 0
        new = 0
        if kind.endswith(".delta"):
            new = 1
            if kind == "response.output_text.delta" and isinstance(event.get("delta"), str):
                self.text.append(event["delta"])
        response = event.get("response")
        if isinstance(response, dict):
            self.response = response
            usage = response.get("usage")
            if kind in _FINAL:
                self.finished.add(0)
                if isinstance(usage, dict):
                    self.usage = usage
                    total = usage.get("output_tokens")
                    if isinstance(total, int) and total > self.completion_tokens + new:
                        new = total - self.completion_tokens
        self.completion_tokens += new
        frame = b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"
        return frame, new

    def partial(self, reason: str) -> Json:
        """The reply of a response the gateway cut: what came so far, marked incomplete."""
        response: Json = copy.deepcopy(self.response) if self.response else {"object": "response"}
        text = "".join(self.text) + notice_for(reason)
        response.update(
            status="incomplete",
            incomplete_details={"reason": reason},
            output=[
                {
                    "type": "message",
                    "role": "assistant",
                    "status": "incomplete",
                    "content": [{"type": "output_text", "text": text, "annotations": []}],
                }
            ],
        )
        return response


def _error_of(event: Json) -> Json:
    error = event.get("error")
    if isinstance(error, dict):
        return error
    response = event.get("response")
    if isinstance(response, dict) and isinstance(response.get("error"), dict):
        return dict(response["error"])
    return {"message": str(event.get("message") or "the backend failed the response")}


class ResponsesSession(StreamSession):
    """A governed Responses request: the session's lifecycle, with Responses shapes."""

    until_done = False  # vLLM's Responses stream just ends, after `response.completed`

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.parser: ResponsesParser = ResponsesParser(self.prepared.options)  # type: ignore[assignment]
        self._cut: str | None = None

    async def _emit(self, chunk: Item) -> None:
        if self.streaming:
            await self.window.put(chunk)
        # A non-streaming client gets the final response object, which the parser keeps.

    def on_cut(self, reason: str) -> None:
        if reason in ("client_stall", "upstream_error"):
            super().on_cut(reason)
            return
        self._ended = True
        self.end = self._cut = reason
        self._stop_reading()
        self.ctx.metrics.truncated(reason)
        if self.streaming:
            event = {
                "type": "error",
                "code": reason,
                "message": notice_for(reason).strip(),
                "param": None,
            }
            data = json.dumps(event, separators=(",", ":")).encode()
            self.window.put_final(b"event: error\ndata: " + data + b"\n\n")
        self.ready.set()

    def response(self) -> Json:
        """The non-streaming reply, once `done`."""
        parser = self.parser
        if self._cut is not None or parser.response is None:
            return parser.partial(self._cut or self.end)
        return parser.response


class ResponsesStream(SessionStream):
    """Writes a Responses session's events as vLLM framed them (no `[DONE]`, no merging)."""

    async def _write(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        window = self.session.window
        while frames := await window.take():
            body = b"".join(f if isinstance(f, bytes) else _error_frame(f) for f in frames)
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _error_frame(item: Json) -> bytes:
    error = item.get("error", item)
    event = {"type": "error", **(error if isinstance(error, dict) else {"message": str(error)})}
    return b"event: error\ndata: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
