"""The live dashboard in a real browser: Debian's headless chromium, driven over the DevTools
protocol, watches `/dashboard` of a real `llmflow serve` in front of a real, slowed
`llmflow simserve` while the test streams a request through it.

What is read is the page the browser rendered, at several moments: the request's row appears,
its KV blocks grow while it streams, and it is gone once it ends; the charts have drawn points;
a refusal the test provoked shows as a rate; the TTFT p50 agrees with what the client measured.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.processes import GatewayProcess, SimServeProcess

from .browser import Browser

pytestmark = pytest.mark.slow

MODEL = "sim"
SPEED = "0.2"  # a simulated H100 at a fifth of its speed: ~30 tokens/s, a KV block every ~0.5 s
MAX_TOKENS = 150  # about five seconds of streaming
TTFT_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0)


def _config(url: str) -> dict[str, Any]:
    return {
        # One slot and no queue: a second request while the first streams is refused.
        "gate": {"max_concurrency_per_gpu": 1, "queue": {"max_waiting": 0}},
        "sla": {"ttft_ms": None},
        "streaming": {"first_token_timeout_ms": None},
        "metrics": {"scrape_interval_ms": 200},
        "backends": [{"name": "sim0", "url": url, "models": [MODEL], "max_model_len": 8192}],
    }


def _cell(request_id: int, key: str) -> str:
    return (
        f"document.querySelector('#requests tr[data-id=\"{request_id}\"] td[data-key={key}]')"
        "?.textContent"
    )


def _points(series: str) -> str:
    return f"Number(document.querySelector('path[data-series=\"{series}\"]')?.dataset.points || 0)"


class Stream(threading.Thread):
    """A streamed completion, read to its end; when its first and last bytes came."""

    def __init__(self, base: str) -> None:
        super().__init__(daemon=True)
        self.base = base
        self.sent = self.first = self.done = 0.0
        self.status = 0

    def run(self) -> None:
        body = {
            "model": MODEL,
            "prompt": "hello " * 200,
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "ignore_eos": True,
        }
        self.sent = time.monotonic()
        with httpx.stream("POST", f"{self.base}/v1/completions", json=body, timeout=60) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data:") and not self.first:
                    self.first = time.monotonic()
        self.done = time.monotonic()


def test_a_streamed_request_appears_grows_and_goes_and_the_charts_follow(tmp_path: Path) -> None:
    with (
        SimServeProcess(tmp_path, "--model-name", MODEL, "--speed", SPEED) as backend,
        GatewayProcess(_config(backend.url), tmp_path) as gw,
        Browser(tmp_path) as page,
    ):
        page.goto(f"{gw.url}/dashboard")
        page.wait_for("document.getElementById('status').textContent.includes('running 0')")
        stream = Stream(gw.url)
        stream.start()
        row = "document.querySelector('#requests tr[data-id]')"
        request_id = int(page.wait_for(f"{row}?.dataset.id"))
        page.wait_for(f"{_cell(request_id, 'state')} === 'streaming'")
        first_kv = int(page.evaluate(_cell(request_id, "kv_blocks")))

        # While it streams: its row as the core describes it, and a second request refused.
        live = {r["id"]: r for r in gw.state()["core"]["requests"]}[request_id]
        assert page.evaluate(_cell(request_id, "tier")) == "normal"
        assert page.evaluate(_cell(request_id, "backend")) == "sim0"
        assert page.evaluate(_cell(request_id, "priority")) == str(live["priority"])
        refused = httpx.post(
            f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}
        )
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "queue_full"
        page.wait_for(f"{_points('queue_full')} > 0")
        rate = page.wait_for(
            "(() => { const p = refusalSeries().find(s => s.name === 'queue_full').points;"
            " return Math.max(...p.map(([, v]) => v || 0)); })()"
        )
        assert rate > 0

        # Its KV footprint grows on the page, read from the DOM again.
        grown = page.wait_for(
            f"Number({_cell(request_id, 'kv_blocks')}) > {first_kv}"
            f" && Number({_cell(request_id, 'kv_blocks')})"
        )
        assert grown > first_kv
        if shots := os.environ.get("LLMFLOW_SCREENSHOT_DIR"):
            page.screenshot(Path(shots) / "dashboard.png")

        stream.join(timeout=60)
        assert stream.done, "the stream did not finish"
        assert stream.status == 200
        page.wait_for(f"!{row} && document.getElementById('count').textContent === '(0)'")
        assert page.evaluate(_cell(request_id, "kv_blocks")) is None

        # The charts drew what happened: KV on sim0, the request in flight, its TTFT.
        assert page.evaluate(_points("sim0")) >= 2
        in_flight = page.evaluate(
            "tierSeries().find(s => s.name === 'normal in flight').points.map(([, v]) => v)"
        )
        assert max(in_flight) == 1
        assert in_flight[-1] == 0
        p50 = page.wait_for(
            "(() => { const p = ttftSeries()[0].points.filter(([, v]) => v != null);"
            " return p.length && p[p.length - 1][1]; })()"
        )
        # The gateway times from arrival to the first token it relays: within the client's
        # TTFT, so in its bucket or a lower one.
        client_ttft = stream.first - stream.sent
        bucket = bisect.bisect_left(TTFT_BOUNDS, client_ttft)
        assert 0 < p50 <= TTFT_BOUNDS[min(bucket, len(TTFT_BOUNDS) - 1)], (p50, client_ttft)
