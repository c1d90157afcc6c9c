"""Test harness: real uvicorn servers on loopback inside the test's event loop.

Streaming, disconnects and backpressure need real sockets (httpx's in-process transport buffers
whole responses and never disconnects), so the fake vLLM and the gateway both run as uvicorn
servers on ephemeral ports, in the same loop as the test: what a test sees is deterministic up
to the scheduling of that one loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import uvicorn

from llmflow.config import Settings, load_settings
from llmflow.gateway.app import Gateway, create_app
from llmflow.gateway.embedded import QuietServer
from llmflow.gateway.front import FrontDoor
from llmflow.gateway.guard import GuardProtocol
from llmflow.gateway.listener import server_options
from llmflow.sim import server as sim_server

from .fake_vllm import FakeVllm

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
    from typing import TextIO

__all__ = [
    "NATIVE_IDS",
    "Harness",
    "assert_idle",
    "on_a_loop_of_their_own",
    "port_refuses",
    "serve_asgi",
    "serve_gateway",
    "served_by",
    "settings_for",
    "start_gateway",
    "start_gateway_losing_its_backend",
    "start_sim_gateway",
    "until",
]

T = TypeVar("T")
NATIVE_IDS = 1 << 40  # the native front numbers its requests from here (`front/owner.rs`)


def served_by(native: bool, *request_ids: str) -> None:
    """Each request id (`llmflow-<n>`, as a client or a backend saw it) is from the native
    front's path (`native`), or from Python's (the app's, `serve_gateway(front=False)`)."""
    for request_id in request_ids:
        assert (int(request_id.removeprefix("llmflow-")) >= NATIVE_IDS) == native, request_id


@contextlib.asynccontextmanager
async def serve_asgi(
    app: Any, sock: socket.socket | None = None, **config: Any
) -> AsyncIterator[tuple[str, QuietServer]]:
    """Serve an ASGI app on `127.0.0.1:<ephemeral>` (or on `sock`, bound); yields (base URL,
    server)."""
    if sock is None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1] if sock.family != socket.AF_UNIX else 0
    config.setdefault("http", GuardProtocol)  # as `llmflow serve` runs the app's listener
    cfg = uvicorn.Config(app, log_level="critical", lifespan="on", access_log=False, **config)
    server = QuietServer(cfg)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("server exited during startup")
            await asyncio.sleep(0.005)
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        await asyncio.wait([task], timeout=15)
        sock.close()


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> float:
    """Wait for `predicate` (polling the loop); fail the test if it takes over `timeout_s`."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, "condition not reached in time"
        await asyncio.sleep(0.002)
    return time.monotonic() - start


def settings_for(
    urls: dict[str, str],
    backend: dict[str, Any] | None = None,
    per_backend: dict[str, dict[str, Any]] | None = None,
    **sections: Any,
) -> Settings:
    """Settings whose backends are `urls` (name -> URL, plus `backend` keys and that backend's
    `per_backend` keys), and overrides."""
    data: dict[str, Any] = {
        "backends": [
            {
                "name": name,
                "url": url,
                "models": ["fake-model"],
                "max_model_len": 4096,
                **(backend or {}),
                **(per_backend or {}).get(name, {}),
            }
            for name, url in urls.items()
        ],
        "metrics": {"scrape_interval_ms": 100, "stale_after_ms": 5000},
        "streaming": {"sse_flush_interval": 0},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return load_settings(data=data)


@dataclass(repr=False)
class Harness:
    """A running gateway in front of fakes, with an HTTP client."""

    url: str
    gateway: Gateway
    client: httpx.AsyncClient
    fakes: dict[str, FakeVllm]
    app: Any = None  # the FastAPI app (an admin app can be built over it)
    sim: Any = None  # the simulated vLLM's app (`start_sim_gateway`): its state is ours to read

    def __repr__(self) -> str:
        return f"Harness({self.url})"

    @property
    def fake(self) -> FakeVllm:
        """The first (often only) fake backend."""
        return next(iter(self.fakes.values()))

    async def settle(self, timeout_s: float = 3.0) -> None:
        """Wait until nothing is live in the gateway or the fakes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not _idle(self):
            await asyncio.sleep(0.01)


def _idle(h: Harness) -> bool:
    g = h.gateway.runtime
    sessions = h.gateway.ctx.sessions if h.gateway.ctx else set()
    return (
        g.running == 0
        and g.queued == 0
        and g.kv_blocks_in_use == 0
        and h.gateway.runtime.live == 0
        and not sessions
        and all(f.running == 0 for f in h.fakes.values())
    )


async def assert_idle(h: Harness) -> None:
    """In flight, queue and KV ledger back to zero; no session or upstream request left."""
    await h.settle()
    g = h.gateway.runtime
    state = h.gateway.state()
    assert (g.running, g.queued, g.kv_blocks_in_use) == (0, 0, 0), state
    assert h.gateway.runtime.live == 0, state
    assert not h.gateway.ctx or not h.gateway.ctx.sessions, state
    assert [f.running for f in h.fakes.values()] == [0] * len(h.fakes), h.fakes


@contextlib.asynccontextmanager
async def serve_gateway(app: Any, asgi: Any = None, front: bool = True) -> AsyncIterator[str]:
    """Serve a gateway app (`create_app`) as `llmflow serve` does: the front door on a loopback
    port, uvicorn on a private unix socket behind it (serving `asgi`, a wrapper of `app`, when
    given); yields the base URL.

    `front=False` serves the app alone, by uvicorn on the loopback port: every request is the
    app's, as the front passes it what it declines (the Python path, the reference the
    differential tests hold the native front's answers to)."""
    settings = app.state.settings
    if not front:
        async with serve_asgi(asgi or app, **server_options(settings)) as (url, _):
            yield url
        return
    door = FrontDoor(settings, "127.0.0.1", 0)
    options = server_options(settings, behind_front=True)
    try:
        async with serve_asgi(asgi or app, door.app_socket, uds=door.app_path, **options):
            door.start(app.state.gateway)
            try:
                yield f"http://127.0.0.1:{door.port}"
            finally:
                door.close()  # before uvicorn stops: its connections from the front close
    finally:
        door.close()


@contextlib.asynccontextmanager
async def start_gateway(
    n_backends: int = 1,
    check_idle: bool = True,
    configure: Callable[[dict[str, FakeVllm]], None] | None = None,
    backend: dict[str, Any] | None = None,
    per_backend: dict[str, dict[str, Any]] | None = None,
    trace: TextIO | None = None,
    native: bool = True,
    **sections: Any,
) -> AsyncIterator[Harness]:
    """Fakes plus a gateway over them (`trace`: where the runtime's trace goes; `native`
    False: the app alone, every request served by Python, `serve_gateway(front=False)`); on
    exit, asserts everything returned to zero."""
    fakes = {f"b{i}": FakeVllm() for i in range(n_backends)}
    if configure is not None:
        configure(fakes)
    async with contextlib.AsyncExitStack() as stack:
        urls = {}
        for name, fake in fakes.items():
            urls[name], _ = await stack.enter_async_context(serve_asgi(fake.app))
        settings = settings_for(urls, backend, per_backend, **sections)
        app = create_app(settings, trace)
        url = await stack.enter_async_context(serve_gateway(app, front=native))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=30))
        harness = Harness(url, app.state.gateway, client, fakes, app)
        yield harness
        if check_idle:
            await assert_idle(harness)


@contextlib.asynccontextmanager
async def start_gateway_losing_its_backend() -> AsyncIterator[Harness]:
    """`start_gateway` over one fake vLLM that then stops, its port refusing connections (vLLM
    gone after the gateway started): the next request's connect is refused (502). On exit,
    asserts everything returned to zero."""
    fake = FakeVllm()
    async with contextlib.AsyncExitStack() as stack:
        fake_url, server = await stack.enter_async_context(serve_asgi(fake.app))
        app = create_app(settings_for({"b0": fake_url}))
        url = await stack.enter_async_context(serve_gateway(app))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=30))
        server.should_exit = True
        port = int(fake_url.rsplit(":", 1)[1])
        await until(lambda: port_refuses("127.0.0.1", port))
        harness = Harness(url, app.state.gateway, client, {"b0": fake}, app)
        yield harness
        await assert_idle(harness)


def port_refuses(host: str, port: int) -> bool:
    """Whether a connection to `host:port` is refused (nothing listens there)."""
    try:
        socket.create_connection((host, port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


@contextlib.contextmanager
def on_a_loop_of_their_own(
    up: Callable[[contextlib.AsyncExitStack[Any]], Awaitable[T]],
) -> Iterator[T]:
    """What `up` starts (entering it on the stack it is given), on an event loop of its own in
    a thread, so synchronous tests (hypothesis, raw sockets) can use it; closed on exit."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    stack = contextlib.AsyncExitStack()
    try:
        yield asyncio.run_coroutine_threadsafe(up(stack), loop).result(60)
    finally:
        asyncio.run_coroutine_threadsafe(stack.aclose(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


SIM_MODEL = "fake-model"  # the model name `settings_for` configures


@contextlib.asynccontextmanager
async def start_sim_gateway(
    sim_options: dict[str, Any] | None = None,
    backend: dict[str, Any] | None = None,
    **sections: Any,
) -> AsyncIterator[Harness]:
    """A gateway (config `sections` over `settings_for`'s, `backend` keys on its backend) in
    front of one simulated vLLM, `sim0` (`llmflow.sim.server`: an H100 with Llama-3-8B at 5x
    real time, plus `sim_options`); on exit, asserts everything returned to zero."""
    sim = sim_server.create_app(
        preset="h100:llama-3-8b",
        speed=5.0,
        models=[SIM_MODEL],
        max_model_len=4096,
        **(sim_options or {}),
    )
    async with serve_asgi(sim) as (sim_url, _):
        app = create_app(settings_for({"sim0": sim_url}, backend, **sections))
        async with serve_gateway(app) as url, httpx.AsyncClient(base_url=url) as client:
            harness = Harness(url, app.state.gateway, client, {}, app, sim)
            yield harness
            await assert_idle(harness)
