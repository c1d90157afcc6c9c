"""vLLM's routes beyond completions that the app serves: the light routes.

`/v1/responses` generates tokens, so the runtime governs it as it does a completion, and the
native front door serves it (`rust/src/front/responses.rs`). The light routes (embeddings,
rerank, score, tokenize, detokenize, audio) pass through under the core's light lane
(`light.py`). Every route authenticates the API key first. The policy of
each route is tabled in `docs/gateway.md`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from llmflow.gateway.errors import GatewayError
from llmflow.gateway.light import LightReply  # noqa: TC001 - FastAPI reads the return type
from llmflow.gateway.routes.deps import gateway, identity

__all__ = ["LIGHT_PATHS", "router"]

router = APIRouter(tags=["vllm"])

# The light routes, as vLLM names them (its aliases included).
LIGHT_PATHS = (
    "/v1/embeddings",
    "/v1/rerank",
    "/v2/rerank",
    "/rerank",
    "/v1/score",
    "/score",
    "/tokenize",
    "/detokenize",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
)


async def _light(request: Request) -> LightReply:
    who = identity(request)  # every route needs a good API key, if keys are configured
    gw = gateway(request)
    if gw.light is None:
        raise GatewayError(503, "the gateway is starting", "not_ready")
    path = request.url.path
    if request.url.query:
        path += "?" + request.url.query
    headers = {k.lower(): v for k, v in request.headers.items()}
    body = await request.body()
    return await gw.light.forward(path, headers, body, request.receive, who.tenant, who.tier)


_MODEL = {"model": {"type": "string", "minLength": 1}}  # the one field the gateway reads
_JSON_BODY = {"application/json": {"schema": {"type": "object", "properties": _MODEL}}}
_FORM_BODY = {
    "multipart/form-data": {
        "schema": {
            "type": "object",
            "required": ["file"],
            "properties": {"file": {"type": "string", "format": "binary"}, **_MODEL},
        }
    }
}

for _path in LIGHT_PATHS:
    _body = _FORM_BODY if _path.startswith("/v1/audio/") else _JSON_BODY
    router.add_api_route(
        _path,
        _light,
        methods=["POST"],
        response_model=None,
        openapi_extra={"requestBody": {"required": True, "content": _body}},
        summary=f"{_path} (light: passed through under a cap)",
    )
