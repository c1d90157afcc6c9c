"""The gateway application: `create_app(settings)` and the runtime its lifespan builds.

The lifespan starts the built-in simulated backends (for backends without a URL), builds the core
runtime from the config, scrapes every backend once so health is known before the first request,
and starts the scrape loop. Shutdown feeds the runtime its drain: it refuses newcomers with
`draining`, lets live requests finish for `server.drain_timeout_ms`, then cuts the rest with a
visible notice; the gateway waits until every session has written its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse

from llmflow._core import Runtime
from llmflow.config import load_settings
from llmflow.gateway.auth import AdminGuard, KeyRing
from llmflow.gateway.embedded import EmbeddedBackend
from llmflow.gateway.errors import install_handlers
from llmflow.gateway.host import Host, now_us
from llmflow.gateway.light import LightService
from llmflow.gateway.metrics import GatewayMetrics
from llmflow.gateway.middleware import BodyLimit, HostGuard, PeerFromFront, allowed_host_names
from llmflow.gateway.protocol import install_schemas
from llmflow.gateway.relay import RelayHost
from llmflow.gateway.routes import admin, openai, ops, playground, vllm, websocket
from llmflow.gateway.routes.deps import admin as admin_key
from llmflow.gateway.scraper import Scraper
from llmflow.gateway.serving import CompletionService
from llmflow.gateway.session import BackendRoute, SessionContext
from llmflow.gateway.shadow import ShadowHost, uncapped_light
from llmflow.gateway.telemetry import Tracing
from llmflow.gateway.upstream import TlsFiles, Upstream

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from typing import TextIO

    from llmflow.config import Settings
    from llmflow.gateway.native import NativeInbox
    from llmflow.gateway.shared_state import SharedSlots

__all__ = ["Gateway", "create_admin_app", "create_app"]

log = logging.getLogger("llmflow.gateway")
_GC_YOUNG_THRESHOLD = 10_000  # allocations between young collections (CPython's default: 700)
_CUT_GRACE_S = 2.0  # past the drain timeout, how long cut streams get to write their end


class Gateway:
    """Everything one running gateway holds; built by `Gateway.start`.

    Args:
        settings: the validated config.
        trace: where to write the runtime's JSONL trace (`llmflow serve --trace`), if anywhere.
    """

    def __init__(self, settings: Settings, trace: TextIO | None = None) -> None:
        self.settings = settings
        self.keyring = KeyRing(settings)
        self.admin_guard = AdminGuard(settings)
        self.embedded: list[EmbeddedBackend] = []
        self.started_at = time.monotonic()
        self.draining = False
        self.shadow: ShadowHost | None = None
        self.host: Host
        if settings.gate.mode == "shadow":  # forwarded as direct; the policy only records
            self.host = self.shadow = ShadowHost(settings, trace)
            self.runtime = self.host.runtime  # the forwarding runtime: what really runs
        else:
            self.runtime = Runtime(settings.to_runtime(), trace=trace is not None)
            self.host = Host(self.runtime, trace)
        self.upstream = Upstream(
            max_event_bytes=settings.server.max_event_bytes,
            tls={
                b.url: TlsFiles(b.tls_ca_file, b.tls_client_cert, b.tls_client_key)
                for b in settings.backends
                if b.url and (b.tls_ca_file or b.tls_client_cert)
            },
        )
        self.metrics = GatewayMetrics(self.host, [t.name for t in settings.tiers])
        self.metrics.draining = lambda: self.draining
        if self.shadow is not None:
            self.metrics.shadow_mode(self.runtime)
        log_path = settings.server.access_log
        if log_path:  # one file, one writer (the core's), whichever path serves a request
            self.metrics.open_access_log(Path(log_path), self.shadow is not None)
        telemetry = settings.telemetry
        self.tracing = Tracing(telemetry) if telemetry.otlp_endpoint is not None else None
        self.metrics.tracing = self.tracing
        self.tasks: set[asyncio.Task[Any]] = set()
        # The model table is the core's (served names, aliases, each pool's backends and
        # policy); the file adds only each backend's context length. The policy runtime's: in
        # shadow mode the forwarding one routes every pool round robin.
        policy_runtime = self.shadow.policy.runtime if self.shadow is not None else self.runtime
        self.pools = policy_runtime.pools()
        self.aliases = dict(policy_runtime.models())  # every name a client may send -> served
        length = {b.name: b.max_model_len for b in settings.backends}
        context = {model: min(length[b] for b in on) for model, _, on in self.pools}
        self.models = {name: context[served] for name, served in self.aliases.items()}
        self.scraper: Scraper | None = None
        self.shared: SharedSlots | None = None  # the Redis I/O, with `state.backend: redis`
        if settings.state.backend == "redis":
            from llmflow.gateway.shared_state import SharedSlots

            self.host.leases = self.shared = SharedSlots(settings, self.host)
        # The front door runs on the relay's threads (and so do the native streams).
        self.relay = RelayHost(settings)
        self.ctx: SessionContext | None = None
        self.service: CompletionService | None = None
        self.light: LightService | None = None
        # What Python does for the completions the native front serves (`front.py` sets it).
        self.native: NativeInbox | None = None

    async def start(self) -> None:
        """Start embedded backends, the scrape loop, and the service."""
        urls: dict[str, str] = {}
        for backend in self.settings.backends:
            if backend.url is None:
                embedded = EmbeddedBackend(backend)
                self.embedded.append(embedded)
                urls[backend.name] = await embedded.start()
            else:
                urls[backend.name] = backend.url.rstrip("/")
        s = self.settings
        self.scraper = Scraper(
            self.host, self.upstream, urls, s.metrics.scrape_interval_ms / 1e3, s.kv.block_size
        )
        self.metrics.scraper = self.scraper
        if self.shared is not None:
            from llmflow.gateway.shared_scrape import SharedScrapes

            self.scraper.shared = SharedScrapes(self.shared, s.metrics.scrape_interval_ms)
        light_settings = uncapped_light(s) if self.shadow is not None else s
        serving = {model: on for model, _, on in self.pools}
        self.light = light = LightService(light_settings, urls, self.upstream.client, serving)
        scraper_on_health = self.host.on_health

        def on_health(backend: str, healthy: bool) -> None:  # the runtime's SetHealth, to both
            scraper_on_health(backend, healthy)
            light.on_health(backend, healthy)

        self.host.on_health = on_health
        self.ctx = SessionContext(
            host=self.host,
            upstream=self.upstream,
            metrics=self.metrics,
            routes={  # shadow mode sends no priority, as direct sends none
                b.name: BackendRoute(
                    urls[b.name], b.scheduling_policy == "priority" and self.shadow is None
                )
                for b in s.backends
            },
            client_window=s.backpressure.client_window,
            pause_when_full=s.backpressure.pause_when_full,
            tasks=self.tasks,
            tracing=self.tracing,
        )
        self.metrics.relay = self.relay.relay
        prefix_models = frozenset(m for m, policy, _ in self.pools if policy == "prefix")
        self.service = CompletionService(
            self.ctx,
            self.models,
            s.server.bytes_per_token,
            s.streaming.enabled,
            s.limits,
            aliases=self.aliases,
            prefix_models=prefix_models,
            block_size=s.kv.block_size,
        )
        if self.shared is not None:
            await self.shared.sync()
            self.shared.begin(self.tasks)
        await self.scraper.scrape_all()
        self.scraper.start(self.tasks)
        _settle_heap()
        for name, state in self.scraper.states.items():
            log.info(
                "backend %s at %s: %s",
                name,
                state.url,
                "healthy" if state.healthy else f"UNHEALTHY ({state.last_error})",
            )

    async def drain(self) -> None:
        """Feed the runtime its drain, then wait until every session has ended.

        The runtime refuses newcomers at once and cuts what is still live when
        `server.drain_timeout_ms` has passed; this only waits for the sessions to finish
        writing (bounded, in case a client never takes its last bytes).
        """
        if self.ctx is None:
            return
        if not self.draining:
            self.draining = True
            log.info("draining: %d live request(s)", len(self.ctx.sessions) + self._native_live())
            self.host.drain()
            if self.light is not None:
                self.light.lane.start_draining()
        bound = time.monotonic() + self.settings.server.drain_timeout_ms / 1e3 + _CUT_GRACE_S
        while (self.ctx.sessions or self._native_live()) and time.monotonic() < bound:
            await asyncio.sleep(0.01)

    def _native_streams(self, generated: dict[int, int]) -> list[dict[str, Any]]:
        """The requests the native front serves, shaped as `_stream_state`'s (their window of
        unwritten chunks is the relay's: not counted here, None)."""
        if self.native is None:
            return []
        now = now_us()
        return [
            {
                "id": s["id"],
                "tenant": s["tenant"],
                "tier": s["tier"],
                "backend": s["backend"],
                "queued": s["backend"] is None,
                "streaming": s["streaming"],
                "tokens": generated.get(s["id"], 0),
                "window": None,
                "age_s": round((now - s["arrived_us"]) / 1e6, 3),
            }
            for s in self.native.native.streams()
        ]

    def _native_live(self) -> int:
        return self.native.native.live if self.native is not None else 0

    async def stop(self) -> None:
        """Drain, then stop scraping, cancel background work and close every connection."""
        await self.drain()
        if self.scraper is not None:
            await self.scraper.stop()
        if self.shared is not None:
            await self.shared.close()
        for task in list(self.tasks):
            task.cancel("llmflow gateway shutting down")
        if self.tasks:
            await asyncio.wait(list(self.tasks))
        if self.native is not None:
            self.native.close()
        self.host.close()
        self.relay.close()
        await self.upstream.aclose()
        for embedded in self.embedded:
            await embedded.stop()
        self.metrics.close()
        if self.tracing is not None:  # the last spans go out (blocking: off the loop)
            await asyncio.to_thread(self.tracing.close)

    def state(self) -> dict[str, Any]:
        """The JSON snapshot behind `/api/state` and the dashboard."""
        sessions = list(self.ctx.sessions) if self.ctx else []
        core = self.runtime.snapshot(now_us())
        generated = {r["id"]: r["generated_tokens"] for r in core.get("requests", ())}
        state = {
            "draining": self.draining,
            "uptime_s": round(time.monotonic() - self.started_at, 3),
            "core": core,
            "backends": {n: s.as_json() for n, s in self.scraper.states.items()}
            if self.scraper
            else {},
            "streams": [
                *(_stream_state(s, generated) for s in sessions),
                *self._native_streams(generated),
            ],
            "outcomes": [
                {"outcome": o, "reason": r, "count": c}
                for (o, r), c in sorted(self.metrics.outcomes.items())
            ],
            "ttft": self.metrics.ttft_buckets(),
        }
        if self.shadow is not None:  # shadow mode: the policy runtime's state, beside what runs
            state["shadow"] = self.shadow.policy.runtime.snapshot(now_us())
        return state


def _settle_heap() -> None:
    """Keep Python's cyclic GC off the request path.

    Everything alive once the gateway has started (modules, FastAPI's routes, pydantic's
    validators) lives as long as the process: `gc.freeze` moves it out of the collector's
    sight, so a full collection scans only what requests allocate. A profile at 64 relayed
    streams found 37% of the event loop's time in `gc_collect_main`, triggered by ordinary
    per-request allocations; vLLM freezes its heap after start-up for the same reason. The
    higher first threshold makes young collections rarer (a request allocates hundreds of
    objects); what requests leave in cycles is still collected.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(_GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def _stream_state(session: Any, generated: dict[int, int]) -> dict[str, Any]:
    # The core counts every stream's tokens as they are reported (the relay's every 20 ms);
    # a stream it no longer holds shows what its reader counted.
    tokens = generated.get(session.request_id, session.parser.completion_tokens)
    return {
        "id": session.request_id,
        "tenant": session.prepared.tenant,
        "tier": session.prepared.tier,
        "backend": session.backend,
        "queued": session.queued,
        "streaming": session.streaming,
        "tokens": tokens,
        "window": len(session.window),
        "age_s": round(time.monotonic() - session.prepared.arrived, 3),
    }


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    gateway = Gateway(app.state.settings, app.state.trace)
    app.state.gateway = gateway
    try:
        await gateway.start()
        yield
    finally:
        await gateway.stop()


def create_app(settings: Settings | None = None, trace: TextIO | None = None) -> FastAPI:
    """Build the gateway app; its lifespan starts the runtime.

    Args:
        settings: the validated config (default: every default, one built-in simulated backend).
        trace: an open text file for the runtime's JSONL trace (`llmflow trace replay` reads it).

    Returns:
        The FastAPI app, ready for any ASGI server.
    """
    settings = settings or load_settings()
    # With the admin routes on a listener of their own, the schema goes with them (behind the
    # admin key): the main port serves only what clients call.
    openapi_url = "/openapi.json" if settings.admin.port is None else None
    app = FastAPI(
        title="llmflow gateway",
        lifespan=_lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=openapi_url,
    )
    app.state.settings = settings
    app.state.trace = trace
    install_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=settings.server.max_body_bytes)
    if not settings.auth_enabled:  # anyone who reaches the port may use it: only our own names
        names = allowed_host_names([settings.server.host, *settings.server.allowed_hosts])
        app.add_middleware(HostGuard, allowed=names)
    for module in (openai, vllm, ops, websocket, playground):
        app.include_router(module.router)
    if settings.admin.port is None:  # no admin listener: the admin routes stay here
        app.include_router(admin.router)
    app.add_middleware(PeerFromFront)  # outermost: every layer sees the client's address
    install_schemas(app)
    return app


def create_admin_app(main: FastAPI) -> FastAPI:
    """Build the admin listener's app: `/api/state`, `/dashboard`, `/metrics` of `main`'s gateway.

    It has no lifespan of its own: it reads the gateway that `main`'s lifespan starts, so serve
    it once `main` has started.

    Args:
        main: the app from `create_app` (its config has `admin.port` set).

    Returns:
        The admin app (`/api/state`, `/dashboard`, `/metrics`, and the main listener's
        `/openapi.json`); every route needs `admin.api_key`.
    """
    app = FastAPI(title="llmflow admin", docs_url=None, redoc_url=None, openapi_url=None)
    app.state = main.state  # the same settings and, once started, the same gateway
    install_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=main.state.settings.server.max_body_bytes)
    app.include_router(admin.router)

    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(admin_key)])
    async def openapi() -> JSONResponse:
        """The main listener's OpenAPI document, moved here with the admin routes."""
        return JSONResponse(main.openapi())

    return app
