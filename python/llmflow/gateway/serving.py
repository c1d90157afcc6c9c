"""The completion service of the WebSocket route: validate, submit to the core, hand back a
session.

No FastAPI here. The route passes raw bytes; the service answers with a `StreamSession` the
runtime admitted (or queued), or a `GatewayError`. Everything that can refuse a request without
a backend (JSON, types, model, context length, the core's decision) runs before any backend is
touched. HTTP requests to these routes are the native front door's (`rust/src/front/`), whose
checks are the twin of `prepare` (`tests/gateway/test_front_checks.py` holds them together).
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import anyio
from pydantic import ValidationError

from llmflow.config import Limits
from llmflow.gateway.errors import GatewayError
from llmflow.gateway.prefix import chat_prefix_hashes, completion_prefix_hashes
from llmflow.gateway.protocol import ChatCompletionRequest, CompletionRequest, decode_json
from llmflow.gateway.session import Prepared, StreamSession, body_fingerprint
from llmflow.gateway.streaming import ClientOptions
from llmflow.gateway.tokens import chat_prompt_tokens, completion_prompts_tokens

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from llmflow.gateway.auth import Identity
    from llmflow.gateway.session import SessionContext
    from llmflow.gateway.types import Endpoint, Receive

__all__ = ["ClientGone", "CompletionService", "Departure"]

_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# Fields a client may not set, as they steer the engine: the core computes the priority, and
# kv_transfer_params would let a tenant pin KV blocks past its request's end (the ledger
# counting them free) or name a host for the KV connector to reach (`disagg.py` sets them).
_STRIPPED = ("priority", "kv_transfer_params")
_PROMPT_SHAPES = (  # a union's first error ("should be a valid string") would mislead
    "send text, or token ids (integers from 0 to 2147483647), or a list of one of either"
)


class ClientGone(GatewayError):
    """The client disconnected before the reply was ready (nobody reads this answer)."""

    def __init__(self) -> None:
        super().__init__(499, "client closed the request", "client_closed")


class CompletionService:
    """Serves `/v1/completions` and `/v1/chat/completions` under the core's governance.

    Args:
        ctx: the shared session runtime.
        models: served model name -> context length (the smallest among its backends).
        bytes_per_token: UTF-8 bytes per token for prompt estimates.
        streaming: whether clients may ask for `stream` (`streaming.enabled`).
        limits: what one request may ask for (`limits`).
        aliases: alias -> the served model it routes to (`models` in the config); the body
            vLLM gets names the served model.
        prefix_models: served models whose pool routes by prefix: their requests carry the
            prompt's block hashes (`gateway/prefix.py`).
        block_size: tokens per KV block (`kv.block_size`), the unit of those hashes.
    """

    def __init__(
        self,
        ctx: SessionContext,
        models: dict[str, int],
        bytes_per_token: float,
        streaming: bool = True,
        limits: Limits | None = None,
        *,
        aliases: dict[str, str] | None = None,
        prefix_models: frozenset[str] = frozenset(),
        block_size: int = 16,
    ) -> None:
        self.ctx, self.models, self.bytes_per_token = ctx, models, bytes_per_token
        self.streaming = streaming
        self.limits = limits or Limits()
        self.aliases = aliases or {}
        self.prefix_models = prefix_models
        self.block_size = block_size

    def prepare(self, endpoint: Endpoint, identity: Identity, raw: bytes) -> Prepared:
        """Check a request body completely, without touching a backend.

        Raises:
            GatewayError: 400 (bad JSON, wrong types, a limit passed, prompt too long), 404
                (unknown model).
        """
        body = decode_json(raw)
        _check_messages(body, self.limits.max_messages)
        model_cls = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
        try:
            request: Any = model_cls.model_validate(body)
        except ValidationError as exc:
            raise _invalid(exc) from None
        stream = request.streamed
        if body.get("stream_options") and not stream:  # vLLM's own check: `{}` passes
            raise GatewayError(
                400,
                "Stream options can only be defined when `stream=True`.",
                "invalid_request",
                param="stream_options",
            )
        if stream and not self.streaming:
            raise GatewayError(
                400,
                "streaming is disabled on this gateway (streaming.enabled)",
                "streaming_disabled",
                param="stream",
            )
        context = self.models.get(request.model)
        if context is None:
            raise GatewayError(
                404,
                f"The model `{request.model}` does not exist.",
                "model_not_found",
                param="model",
            )
        model = self.aliases.get(request.model, request.model)
        hashes = None
        n = request.n or 1  # chat's `n` is nullable
        if endpoint == "chat":
            prompts = [chat_prompt_tokens(request, self.bytes_per_token)]
            max_tokens = request.max_completion_tokens or request.max_tokens
            if model in self.prefix_models:
                hashes = chat_prefix_hashes(request, self.block_size, self.bytes_per_token)
        else:
            prompts = completion_prompts_tokens(request, self.bytes_per_token)
            max_tokens = request.max_tokens
            _check_zero_tokens(max_tokens, bool(request.echo))
            if model in self.prefix_models:
                hashes = completion_prefix_hashes(request, self.block_size, self.bytes_per_token)
        # A batch is `n` choices per prompt, indexed prompt by prompt as vLLM does
        # (`prompt * n + choice`); the limit counts them all.
        choices = n * len(prompts)
        _check_limits(choices, len(prompts), max_tokens, self.limits)
        longest = max(prompts, default=0)
        _check_context(longest, max_tokens, context)
        options = request.stream_options
        client = ClientOptions(
            endpoint,
            request.model,
            stream,
            choices,
            bool(options and options.include_usage),
            bool(options and options.continuous_usage_stats),
        )
        upstream = {k: v for k, v in body.items() if k not in _STRIPPED}
        upstream["model"] = model  # an alias goes to vLLM as the name it serves
        # vLLM computes prompt logprobs only for a reply it does not stream (its stream refuses
        # `prompt_logprobs`, and fails on an echo with `logprobs` and n > 1): such a request
        # goes upstream as the client sent it (`Prepared.unstreamed`); every other one streams.
        unstreamed = not stream and _wants_prompt_logprobs(body)
        if not unstreamed:
            upstream["stream"] = True
            upstream["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        cap = self.limits.max_tokens
        if max_tokens is None and cap is not None and cap < context - longest:
            max_tokens = upstream["max_tokens"] = cap  # the gateway's bound holds upstream too
        # The core plans KV for what the batch may hold at its peak: every prompt, and each
        # prompt's `n` choices up to their bound (the rest of the context when unbounded).
        generated = sum(n * _planned_output(max_tokens, p, context) for p in prompts)
        return Prepared(
            client,
            identity.tenant,
            identity.tier,
            _PATHS[endpoint],
            upstream,
            sum(prompts),
            generated,
            model,
            hashes,
            body_fingerprint(raw),
            unstreamed=unstreamed,
        )

    def admit(self, prepared: Prepared) -> StreamSession:
        """Announce a prepared request to the runtime.

        Args:
            prepared: the validated request.

        Returns:
            Its session (started or waiting); go on with `StreamSession.start`.

        Raises:
            GatewayError: the runtime refused it at once: 429 with `Retry-After` (503 when the
                reason is draining or no healthy backend).
        """
        session = StreamSession(self.ctx, prepared)
        try:
            session.arrive()
        except GatewayError as exc:
            self.ctx.metrics.rejected(prepared, exc)
            raise
        return session


class Departure:
    """Whether the client has left, and the waits to cancel when it does.

    A client leaving cancels whatever its handler is waiting on (admission, the first token,
    the whole reply), so the `finally` that releases its ticket runs at once.
    """

    def __init__(self) -> None:
        self.left = False
        self._scopes: set[anyio.CancelScope] = set()

    def leave(self) -> None:
        """The client is gone: cancel every wait of its handler."""
        self.left = True
        for scope in self._scopes:
            scope.cancel()

    async def run(self, awaitable: Awaitable[object]) -> None:
        """Await `awaitable` unless the client leaves first.

        Raises:
            ClientGone: the client left before `awaitable` finished (it is cancelled).
        """
        if self.left:
            if isinstance(awaitable, Coroutine):
                awaitable.close()
            raise ClientGone
        with anyio.CancelScope() as scope:
            self._scopes.add(scope)
            try:
                await awaitable
            finally:
                self._scopes.discard(scope)
        if scope.cancelled_caught and self.left:
            raise ClientGone


async def _watch_disconnect(receive: Receive, departure: Departure) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    departure.leave()


def _check_messages(body: dict[str, Any], limit: int) -> None:
    # Before validation: a million tiny messages would cost their validation first.
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > limit:
        raise GatewayError(
            400,
            f"messages has {len(messages)} entries, over this gateway's limit of {limit} "
            "(limits.max_messages): send fewer, or merge them",
            "too_many_messages",
            param="messages",
        )


def _check_limits(choices: int, prompts: int, max_tokens: int | None, limits: Limits) -> None:
    if choices > limits.max_n:
        asked = (
            f"n is {choices}"
            if prompts == 1
            else (f"{prompts} prompts x n {choices // prompts} make {choices} choices")
        )
        raise GatewayError(
            400,
            f"{asked}, over this gateway's limit of {limits.max_n} choices per request "
            "(limits.max_n): ask for fewer, or send several requests",
            "n_too_large",
            param="n",
        )
    cap = limits.max_tokens
    if cap is not None and max_tokens is not None and max_tokens > cap:
        raise GatewayError(
            400,
            f"max_tokens is {max_tokens}, over this gateway's limit of {cap} "
            f"(limits.max_tokens): ask for at most {cap}",
            "max_tokens_too_large",
            param="max_tokens",
        )


def _invalid(exc: ValidationError) -> GatewayError:
    first = exc.errors()[0]
    # The field's path, without pydantic's union-member tags (`stop.list[str]`, `...str`).
    param = ".".join(str(p) for p in first["loc"] if not _is_tag(p)) or None
    got = "" if first["type"] == "missing" else f" (got {first.get('input')!r:.80})"
    message = f"{param}: {first['msg']}"
    if first["loc"][:1] == ("prompt",) and len(first["loc"]) > 1:  # a union member's error
        param, message = "prompt", f"prompt: {_PROMPT_SHAPES}"
    return GatewayError(400, f"{message}{got}", "invalid_request", param=param)


def _is_tag(part: int | str) -> bool:
    return isinstance(part, str) and (
        "[" in part or part in ("str", "int", "float", "bool", "list", "dict")
    )


def _check_zero_tokens(max_tokens: int | None, echo: bool) -> None:
    # vLLM's rule: no output tokens is a request for the echoed prompt alone.
    if max_tokens == 0 and not echo:
        raise GatewayError(
            400,
            "max_tokens must be at least 1, got 0 (0 is allowed only with echo)",
            "invalid_request",
            param="max_tokens",
        )


def _wants_prompt_logprobs(body: dict[str, Any]) -> bool:
    value = body.get("prompt_logprobs")
    echoed = bool(body.get("echo")) and body.get("logprobs") is not None  # the prompt's own
    return echoed or (value is not None and value is not False and value != 0)


def _check_context(prompt: int, max_tokens: int | None, context: int) -> None:
    # vLLM's rule: a prompt must leave room for one token, and `max_tokens` may not pass the
    # context; a `max_tokens` past what the prompt leaves is clamped to it (`_planned_output`).
    if prompt >= context:
        raise GatewayError(
            400,
            f"This model's maximum context length is {context} tokens. However, your prompt "
            f"contains about {prompt} tokens, which leaves no room for output. Please reduce "
            "the length of the input prompt.",
            "context_length_exceeded",
            param="input_tokens",
        )
    if max_tokens is not None and max_tokens > context:
        raise GatewayError(
            400,
            f"max_tokens={max_tokens} cannot be greater than this model's maximum context "
            f"length of {context} tokens. Please request fewer output tokens.",
            "context_length_exceeded",
            param="max_tokens",
        )


def _planned_output(max_tokens: int | None, prompt: int, context: int) -> int:
    """What one choice may generate after `prompt`: its bound, clamped to the context left (as
    vLLM clamps it), at least the one token vLLM counts for an echo alone."""
    left = context - prompt
    return max(min(max_tokens, left) if max_tokens is not None else left, 1)
