"""A `/api/state` with a thousand requests in flight, made by the real core, and a tiny server
that serves it beside the real dashboard page.

A thousand real streams through `llmflow serve` would take the test machine's two cores for
the whole test; what the page has to cope with is the snapshot, so the core itself makes one:
a real `Governor` admits the requests and counts their tokens, and its `snapshot` is the `core`
part of the state, as `Gateway.state` puts it. The backends' scrape part is the scraper's own
`BackendState.as_json`. Only the streams list (the Python sessions) is left empty.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from llmflow._core import Admitted, Governor
from llmflow.config import load_settings
from llmflow.gateway.dashboard import PAGE
from llmflow.gateway.scraper import BackendState

__all__ = ["StateServer", "busy_core", "busy_state", "state_of"]

TENANTS = [("acme", "vip"), ("shop", "normal"), ("etl", "batch")]


def busy_state(in_flight: int, queued: int = 50) -> dict[str, Any]:
    """`busy_core`'s snapshot as `/api/state` shows it."""
    governor, now = busy_core(in_flight, queued)
    return state_of(governor, now)


def busy_core(in_flight: int, queued: int = 50) -> tuple[Governor, int]:
    """A core offered `in_flight + queued` requests on two backends of
    `in_flight` slots in all, each with its own prompt, token count and so KV footprint.

    At a thousand the core runs `in_flight` of them and queues most of the rest; small runs
    keep some slots free (the latency tiers' headroom).
    """
    settings = load_settings(
        data={
            "gate": {
                "max_concurrency_per_gpu": (in_flight + 1) // 2,
                "queue": {"max_waiting": queued + 10},
            },
            "sla": {"ttft_ms": None},
            "tenants": [
                {"name": name, "tier": tier, "api_keys": [f"k-{name}"]} for name, tier in TENANTS
            ],
            "backends": [{"name": "b0"}, {"name": "b1"}],
        }
    )
    governor = Governor(settings.to_core())
    now = 1_000_000
    running = []
    for i in range(in_flight + queued):
        tenant = TENANTS[i % len(TENANTS)][0]
        decision = governor.submit(i + 1, tenant, 50 + (i * 37) % 900, 2000, now)
        started = [a.request_id for a in governor.dispatch(now)]
        if isinstance(decision, Admitted):
            started.append(i + 1)
        now += 1000
        for request_id in started:  # out of prefill, as the gateway reports a first token
            governor.on_first_token(request_id, now)
            running.append(request_id)
    for n, request_id in enumerate(running):
        governor.on_tokens(request_id, (n * 53) % 1500, now)
    now += 2_000_000
    for i, name in enumerate(("b0", "b1")):  # a scrape, as the scraper feeds the runtime
        governor.observe_backend(
            name, now, kv_usage=0.4 + 0.2 * i, running=in_flight // 2, waiting=0, kv_blocks=100_000
        )
    return governor, now


def state_of(governor: Governor, now: int) -> dict[str, Any]:
    """The governor's snapshot at `now` in `Gateway.state`'s shape."""
    core = governor.snapshot(now)
    backends = {
        b["name"]: BackendState(
            name=b["name"],
            url=f"http://10.0.0.{i}:8000",
            kv_usage=0.4 + 0.2 * i,
            running=b["reported_running"],
            waiting=0,
            preemptions_total=0,
            scraped_at=time.monotonic(),
        ).as_json()
        for i, b in enumerate(core["backends"])
    }
    return {
        "draining": False,
        "uptime_s": 0.0,
        "core": core,
        "backends": backends,
        "streams": [],
        "outcomes": [],
        "ttft": {"bounds": [0.1, 1.0], "by_tier": {}},
    }


class StateServer:
    """`/dashboard` (the gateway's page) and `/api/state` (`state`, its `uptime_s` the time
    since the server started, as the gateway's is) on `127.0.0.1:<ephemeral>`."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state
        started = time.monotonic()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/dashboard":
                    body, kind = PAGE.encode(), "text/html; charset=utf-8"
                elif self.path == "/api/state":
                    state = {**owner.state, "uptime_s": round(time.monotonic() - started, 3)}
                    body, kind = json.dumps(state).encode(), "application/json"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        """Base URL."""
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> StateServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
