"""The light routes: vLLM's endpoints that generate no tokens, passed through under a cap.

Embeddings, rerank, score, tokenize, detokenize and audio transcription/translation do not
decode, so the runtime's slots, queue and KV accounting do not fit them. They go through the
core's `LightLane` instead, which admits each on a backend under `backends[].light_concurrency`
or refuses it at once (429 or 503, with its computed Retry-After); this module only carries
that out: it checks what it can without a backend (the API key, a JSON body, a known model),
forwards the body's bytes as they came (multipart audio too), and streams the backend's reply
back as it comes. The slot is released when the reply ends, fails or the client leaves; a
client that leaves closes the upstream request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from typing import TYPE_CHECKING

import anyio
import httpx
from starlette.responses import Response

from llmflow._core import LightLane, LightRefusal
from llmflow.gateway.errors import GatewayError
from llmflow.gateway.host import now_us
from llmflow.gateway.protocol import decode_json
from llmflow.gateway.serving import ClientGone, Departure
from llmflow.gateway.upstream import _error_message, why

if TYPE_CHECKING:
    from llmflow.config import Settings
    from llmflow.gateway.types import Receive, Scope, Send

__all__ = ["LightReply", "LightService"]

_STRIPPED = ("priority", "kv_transfer_params")  # the gateway's to set, never the client's
_FORWARDED = ("content-type", "accept")  # request headers the backend needs to read the body
_ERROR_BODY_LIMIT = 64 * 1024  # bytes of a backend's error body worth reading
_RETURNED = ("content-type", "content-encoding")  # response headers the client gets back
_MESSAGES = {
    "light_lane_full": "too many embedding/rerank/score/tokenize/audio requests in flight on "
    "every backend that serves this model (backends[].light_concurrency); retry after the "
    "Retry-After header's seconds",
    "no_healthy_backend": "no healthy backend serves this request now",
    "rate_limited": "over this API key's rate limit (requests per second); retry after the "
    "Retry-After header's seconds",
    "draining": "the gateway is shutting down",
    "tier_shed": "this API key's tier is shed on the embedding/rerank/score/tokenize/audio "
    "routes while the lane is this full (tiers[].shed_at); retry after the Retry-After "
    "header's seconds",
}


class LightService:
    """Admits light requests through the core's lane and forwards them.

    Args:
        settings: the config (backends, their light caps, tenants' rate limits, tiers' shares).
        urls: backend name -> base URL.
        client: the HTTP client for backends.
        serving: served model -> the backends that serve it: the core's pools
            (`Runtime.pools`), the one model table.
    """

    def __init__(
        self,
        settings: Settings,
        urls: dict[str, str],
        client: httpx.AsyncClient,
        serving: dict[str, list[str]],
    ) -> None:
        self.lane = LightLane([(b.name, b.light_concurrency) for b in settings.backends])
        for tenant in settings.tenants:  # a tenant's rate limit holds here too
            if tenant.requests_per_s is not None:
                self.lane.set_rate(tenant.name, tenant.requests_per_s)
        for tier in settings.tiers:  # and lower tiers are shed first, as in the queue
            self.lane.set_tier_share(tier.name, tier.shed_at)
        self.urls, self.client = urls, client
        self.serving = serving
        self._ids = itertools.count(1)

    def on_health(self, backend: str, healthy: bool) -> None:
        """The runtime's `SetHealth`, for the lane."""
        self.lane.set_health(backend, healthy)

    def candidates(self, content_type: str, raw: bytes) -> tuple[list[str], bytes]:
        """The backends that may serve this body (all of them when it names no model), and the
        body to send: the client's bytes, less the fields that steer the engine (`priority`:
        a low tier would jump vLLM's queue on a priority-scheduling backend).

        Raises:
            GatewayError: 400 for a JSON route's bad body, 404 for a model nobody serves.
        """
        if not content_type.startswith("application/json"):
            return [], raw  # multipart audio: vLLM reads its form; any backend may answer
        body = decode_json(raw)
        if any(field in body for field in _STRIPPED):
            raw = json.dumps({k: v for k, v in body.items() if k not in _STRIPPED}).encode()
        model = body.get("model")
        if model is None:
            return [], raw
        if not isinstance(model, str) or not model:
            raise GatewayError(
                400, "model: must be a non-empty string", "invalid_request", param="model"
            )
        backends = self.serving.get(model)
        if backends is None:
            raise GatewayError(
                404, f"The model `{model}` does not exist.", "model_not_found", param="model"
            )
        return backends, raw

    async def forward(
        self,
        path: str,
        headers: dict[str, str],
        raw: bytes,
        receive: Receive,
        tenant: str | None = None,
        tier: str | None = None,
    ) -> LightReply:
        """Admit the request on a backend, send it, and wait for the reply's head.

        Args:
            path: the route's path (with its query string, if any).
            headers: the client's request headers (lower-case names).
            raw: the body, as received.
            receive: the client's ASGI channel (to notice it leaving while the backend works).
            tenant: whose request it is (its API key's), for its rate limit.
            tier: its tenant's tier, for the share of the lane's slots it may be let into.

        Raises:
            GatewayError: the lane's refusal (429/503 with Retry-After), 400/404 for bad input,
                502 when the backend is unreachable or fails; `ClientGone` when the client left.
        """
        content_type = headers.get("content-type", "application/json")
        candidates, raw = self.candidates(content_type, raw)
        request_id = next(self._ids)
        decision = self.lane.acquire(request_id, candidates, now_us(), tenant, tier)
        if isinstance(decision, LightRefusal):
            raise GatewayError(
                decision.status,
                _MESSAGES.get(decision.reason, decision.reason),
                decision.reason,
                headers={"Retry-After": str(decision.retry_after_s)},
            )
        release = _Release(self.lane, request_id)
        try:
            response = await self._send(decision, path, headers, raw, request_id, receive)
        except BaseException:
            release()
            raise
        return LightReply(response, release)

    async def _send(
        self,
        backend: str,
        path: str,
        headers: dict[str, str],
        raw: bytes,
        request_id: int,
        receive: Receive,
    ) -> httpx.Response:
        forwarded = {k: headers[k] for k in _FORWARDED if k in headers}
        forwarded["x-request-id"] = f"llmflow-light-{request_id}"
        request = self.client.build_request(
            "POST", self.urls[backend] + path, content=raw, headers=forwarded
        )
        departure = Departure()
        watcher = asyncio.create_task(_watch_disconnect(receive, departure))
        sent: list[httpx.Response] = []

        async def send() -> None:
            sent.append(await self.client.send(request, stream=True))

        try:
            await departure.run(send())
        except httpx.HTTPError as exc:
            raise GatewayError(
                502, f"backend unreachable or failed: {why(exc)}", "backend_unavailable"
            ) from exc
        except ClientGone:
            for response in sent:  # answered just as the client left
                await response.aclose()
            raise
        finally:
            watcher.cancel()
            await asyncio.wait([watcher])
        response = sent[0]
        if response.status_code >= 400:
            raise await _backend_error(response, path)
        return response


async def _backend_error(response: httpx.Response, path: str) -> GatewayError:
    """A backend's error answer, in OpenAI's shape: 4xx with its status and message, 5xx as 502."""
    try:
        raw = b""
        async for chunk in response.aiter_raw():
            raw += chunk
            if len(raw) > _ERROR_BODY_LIMIT:
                break
    finally:
        await response.aclose()
    message = _error_message(raw[:_ERROR_BODY_LIMIT]) or f"answered {response.status_code}"
    status = response.status_code
    if status >= 500:
        return GatewayError(502, f"backend error {status}: {message}", "backend_error")
    if status == 404:  # vLLM registers a pooling route only when its model serves that task
        message = f"the backend answered 404 for {path.split('?')[0]}: {message}"
    return GatewayError(status, message, "backend_rejected")


class _Release:
    """Releases one lane slot, once."""

    def __init__(self, lane: LightLane, request_id: int) -> None:
        self.lane, self.request_id = lane, request_id

    def __call__(self) -> None:
        self.lane.release(self.request_id, now_us())


class LightReply(Response):
    """An ASGI response that streams the backend's reply and releases the slot in `finally`.

    It listens for the client's disconnect while it writes, so a client that leaves
    mid-reply closes the upstream response at once; so does one that reads nothing for
    `server.write_timeout_ms` (the connection's write deadline, `guard.py`), so a client
    that never reads cannot hold a lane slot (or the reply) for ever.
    """

    def __init__(self, upstream: httpx.Response, release: _Release) -> None:
        super().__init__(status_code=upstream.status_code)
        self.upstream, self.release = upstream, release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(_until_disconnect, receive, group.cancel_scope)
                with contextlib.suppress(OSError):  # the client went away while we wrote
                    await self._write(send)
                group.cancel_scope.cancel()
        finally:
            await self.upstream.aclose()
            self.release()

    async def _write(self, send: Send) -> None:
        up = self.upstream
        headers = [
            (k.encode(), v.encode()) for k, v in up.headers.items() if k.lower() in _RETURNED
        ]
        await send({"type": "http.response.start", "status": up.status_code, "headers": headers})
        async for chunk in up.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _watch_disconnect(receive: Receive, departure: Departure) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    departure.leave()


async def _until_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()
