"""The Python path's checks of a `/v1/responses` body, kept as the reference model of the
native front's (`rust/src/front/responses.rs`): `test_front_checks.py` holds every drawn body
to it. It served the route until the native front served every request to it; nothing in the
product calls it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import ValidationError

from llmflow.gateway.errors import GatewayError
from llmflow.gateway.protocol import ResponsesRequest, decode_json
from llmflow.gateway.session import Prepared, body_fingerprint
from llmflow.gateway.streaming import ClientOptions
from llmflow.gateway.tokens import text_tokens

if TYPE_CHECKING:
    from llmflow.gateway.auth import Identity

__all__ = ["prepare_response"]

PATH = "/v1/responses"
_PER_ITEM = 4  # role markers a chat template adds around each input message
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
