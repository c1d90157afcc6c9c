"""The browser side of backpressure: `/playground` and `llmflow-client.js` in a real browser.

Debian's headless chromium, driven over the DevTools protocol (`browser.py`), opens the
playground of an in-process gateway in front of the fake vLLM, through a tap (`ws_tap.py`) that
reads every WebSocket frame on the wire. The page's renderer is slowed with its own slider and
stopped with its own checkbox, and the test counts with instruments the gateway does not own:
chunks and acks on the wire, the tokens the fake vLLM managed to write and the aborts it saw,
the page's JS heap as V8 reports it, and the text the page drew.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from llmflow.gateway.streaming import notice_for

from .browser import CHROMIUM, Browser
from .harness import start_gateway, start_sim_gateway, until
from .playground_page import Page, log_in
from .ws_tap import Tap, ws_tap

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from .harness import Harness

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

WINDOW = 4  # backpressure.client_window
PAD = 4096  # bytes of text per token: ~4 MB of kernel buffers fill within ~1,000 tokens
TOKENS = 12000  # ~48 MB if nothing pushed back
CONTROL_TOKENS = 4000  # ~16 MB of text for the client without a window to hold
SHORT_TOKENS = 2000  # unpadded ("t0 t1 ..."): what a page renders whole
SHOTS = (
    Path(os.environ["LLMFLOW_SCREENSHOT_DIR"]) if "LLMFLOW_SCREENSHOT_DIR" in os.environ else None
)
UNKNOWN = "\u2013"  # what the page shows for a count it cannot know
HEAP_SLACK = 2 * 2**20  # the heap over its idle baseline: a window of 16 KB chunks, and noise


@contextlib.asynccontextmanager
async def _playground(
    tmp_path: Path, gateway: Any, path: str = "/playground"
) -> AsyncIterator[tuple[Harness, Tap, Page]]:
    assert CHROMIUM, "chromium is required (.ci/run installs Debian's chromium)"
    async with gateway as h, ws_tap(h.url) as tap:
        browser = await asyncio.to_thread(Browser, tmp_path)
        try:
            page = Page(browser)
            await asyncio.to_thread(browser.goto, tap.url + path)
            await page.wait_for("document.getElementById('model').options.length > 0")
            yield h, tap, page
        finally:
            await asyncio.to_thread(browser.close)


def _fake_plan(**plan: Any) -> Callable[[dict[str, Any]], None]:
    def configure(fakes: dict[str, Any]) -> None:
        for fake in fakes.values():
            fake.default.update(plan)

    return configure


async def _settled(read: Callable[[], int], quiet_s: float = 0.5, timeout_s: float = 20) -> int:
    """The value of `read()` once it stopped changing for `quiet_s`."""
    deadline = time.monotonic() + timeout_s
    last = read()
    while time.monotonic() < deadline:
        await asyncio.sleep(quiet_s)
        if (now := read()) == last:
            return now
        last = now
    raise AssertionError(f"still changing after {timeout_s} s: {last}")


async def _send(page: Page, max_tokens: int, delay_ms: int) -> None:
    await page.set_value("max-tokens", max_tokens)
    await page.set_value("delay", delay_ms)
    await page.click("#send")


async def test_a_slow_renderer_holds_the_window_pauses_upstream_and_bounds_the_heap(
    tmp_path: Path,
) -> None:
    gateway = start_gateway(
        configure=_fake_plan(chunk_bytes=PAD),
        backend={"max_model_len": 16384},
        backpressure={"client_window": WINDOW, "stall_timeout_ms": 20000},
    )
    async with _playground(tmp_path, gateway) as (h, tap, page):
        baseline = await page.heap()
        await _send(page, TOKENS, delay_ms=250)  # ~4 chunks/s against a backend free to race

        # Slow: the page renders a few chunks; the gateway never owes it more than the window.
        await page.wait_for("Number(document.getElementById('chunks').textContent) >= 6")
        (wire,) = tap.sockets
        assert wire.peak_unacked == WINDOW  # the window filled, and never more than that
        assert (h.fake.completed, h.fake.running) == (0, 1)

        # Stopped: no acks, so the gateway stops reading and the backend's writes stop.
        await page.click("#paused")
        written = await _settled(lambda: h.fake.tokens_sent)
        await asyncio.sleep(1.0)
        assert h.fake.tokens_sent == written  # upstream paused
        assert written < TOKENS // 2  # held at the kernel's buffers, far from the whole reply
        used = await page.heap()
        assert used - baseline < HEAP_SLACK, (baseline, used)
        assert wire.sent - wire.acked == WINDOW
        await page.click("#cancel")
        await until(lambda: h.fake.aborted == 1)
        await page.wait_for("document.getElementById('result').textContent === 'cancelled'")
        await page.click("#paused")

        # The control: a page that acks on receipt and queues its rendering holds what the
        # backend sends, so the bound above is one a client without the window cannot meet.
        held = await page.js(_NAIVE_CLIENT % CONTROL_TOKENS)
        assert held > CONTROL_TOKENS // 8  # merged or not, it all came
        control = await page.heap()
        assert control - baseline > 2 * HEAP_SLACK, (baseline, control)
        await page.js("window.naiveHeld = null")


async def test_a_renderer_that_speeds_up_gets_merged_chunks_and_all_the_text(
    tmp_path: Path,
) -> None:
    gateway = start_gateway(backpressure={"client_window": WINDOW, "stall_timeout_ms": 20000})
    async with _playground(tmp_path, gateway) as (h, tap, page):
        await page.set_value("prompt", "Count upward, one token at a time.")
        await _send(page, SHORT_TOKENS, delay_ms=250)
        await page.wait_for("Number(document.getElementById('chunks').textContent) >= 6")
        rendered = await page.number("tokens")
        assert h.fake.tokens_sent > 10 * rendered, (h.fake.tokens_sent, rendered)  # far behind
        await page.wait_for("Number(document.getElementById('merged').textContent) >= 3")
        if SHOTS is not None:  # the README's picture: held back, merged chunks, the server's view
            await page.wait_for("document.getElementById('chart').dataset.points > 12")
            await asyncio.to_thread(page.browser.screenshot, SHOTS / "playground.png")
        (wire,) = tap.sockets
        sped_up_at = wire.sent
        await page.set_value("delay", 0)
        await page.wait_for(
            "document.getElementById('result').textContent.startsWith('completed')", 60
        )
        assert max(wire.chunk_tokens[sped_up_at:]) > 1  # what waited came merged
        assert wire.peak_unacked == WINDOW
        assert (h.fake.completed, h.fake.tokens_sent) == (1, SHORT_TOKENS)
        assert sum(wire.chunk_tokens) == SHORT_TOKENS
        merged_on_wire = sum(1 for n in wire.chunk_tokens if n > 1)
        assert merged_on_wire > 0
        assert len(wire.chunk_tokens) < SHORT_TOKENS // 2
        assert await page.number("merged") == merged_on_wire
        assert await page.number("tokens") == SHORT_TOKENS
        expected = "".join(f"t{i} " for i in range(SHORT_TOKENS))
        assert "".join(wire.text) == expected
        assert await page.rendered_digest() == hashlib.sha256(expected.encode()).hexdigest()


_NAIVE_CLIENT = """new Promise((resolve) => {
  const ws = new WebSocket(location.origin.replace('http', 'ws') + '/v1/ws');
  const held = window.naiveHeld = [];
  const body = {model: document.getElementById('model').value, max_tokens: %d,
                messages: [{role: 'user', content: 'hi'}]};
  ws.onopen = () => ws.send(JSON.stringify({type: 'request', id: 'naive', endpoint: 'chat', body}));
  ws.onmessage = (event) => {
    const msg = JSON.parse(event.data);
    held.push(msg);
    if (msg.type === 'chunk') ws.send(JSON.stringify({type: 'ack', id: 'naive', seq: msg.seq}));
    if (msg.type === 'end') { ws.close(); resolve(held.length); }
  };
})"""


async def test_a_stopped_renderer_is_cut_after_the_stall_timeout_and_aborted_upstream(
    tmp_path: Path,
) -> None:
    gateway = start_gateway(
        configure=_fake_plan(itl=0.005),
        backpressure={"client_window": 2, "stall_timeout_ms": 1000},
    )
    async with _playground(tmp_path, gateway) as (h, tap, page):
        await page.click("#paused")  # stopped before the first chunk
        await _send(page, 500, delay_ms=0)
        await until(lambda: h.fake.aborted == 1, timeout_s=15)
        (wire,) = tap.sockets
        await until(lambda: bool(wire.ends))
        assert wire.ends == [{"type": "end", "id": 1, "reason": "client_stall", "sent": 2}]
        assert (wire.sent, wire.acked, wire.peak_unacked) == (2, 0, 2)
        assert await page.number("chunks") == 0
        assert h.fake.running == 0
        # Rendering again, the page draws what it held, then learns why nothing more comes.
        await page.click("#paused")
        await page.wait_for(
            "document.getElementById('result').textContent.includes('client_stall')"
        )
        assert await page.number("chunks") == 2
        assert await page.text("status") == "client_stall"


async def test_closing_the_tab_mid_stream_aborts_upstream(tmp_path: Path) -> None:
    gateway = start_gateway(configure=_fake_plan(itl=0.002))
    async with _playground(tmp_path, gateway) as (h, tap, page):
        await _send(page, 2000, delay_ms=200)
        await page.wait_for("Number(document.getElementById('chunks').textContent) >= 2")
        assert (h.fake.running, h.fake.aborted) == (1, 0)
        await asyncio.to_thread(page.browser.ws.send, json.dumps({"id": 0, "method": "Page.close"}))
        await until(lambda: h.fake.aborted == 1, timeout_s=15)
        (wire,) = tap.sockets
        await until(lambda: wire.closed)
        assert h.fake.completed == 0
        assert wire.peak_unacked <= 8  # the default client_window


KEY = "sk-playground-test"


async def test_the_page_needs_a_key_and_the_socket_takes_it_from_the_page(tmp_path: Path) -> None:
    tenants = [{"name": "web", "tier": "normal", "api_keys": [KEY]}]
    gateway = start_gateway(tenants=tenants)
    async with gateway as h, ws_tap(h.url) as tap:
        async with httpx.AsyncClient(base_url=tap.url) as client:
            for auth in (None, ("user", "wrong"), ("user", "")):
                refused = await client.get("/playground", auth=auth)
                assert refused.status_code == 401, refused.text
                assert refused.headers["www-authenticate"].startswith("Basic ")
                assert refused.json()["error"]["code"] == "invalid_api_key"
                assert KEY not in refused.text
            bearer = await client.get("/playground", headers={"authorization": f"Bearer {KEY}"})
            assert bearer.status_code == 200
            assert bearer.headers["cache-control"] == "no-store"
            library = await client.get("/static/llmflow-client.js")  # no secret: no key needed
            assert library.status_code == 200
            assert library.headers["content-type"].startswith("text/javascript")
            types = await client.get("/static/llmflow-client.d.ts")
            assert "export declare function stream" in types.text
            for name in ("nope.js", "..%2Fapp.py", "playground.html"):  # only the listed files
                missing = await client.get(f"/static/{name}")
                assert missing.status_code == 404, name
                assert missing.json()["error"]["code"] == "not_found"
        browser = await asyncio.to_thread(Browser, tmp_path)
        try:
            page = Page(browser)
            # What a user does at the login prompt: any name, the key as password.
            await asyncio.to_thread(log_in, browser, tap.url + "/playground", KEY)
            await page.wait_for("document.documentElement.dataset.auth === 'required'")
            assert await page.js("getComputedStyle(document.getElementById('key-field')).display")
            await page.set_value("api-key", KEY)
            await page.js("document.getElementById('api-key').dispatchEvent(new Event('change'))")
            await page.wait_for("document.getElementById('model').options.length > 0")
            await _send(page, 20, delay_ms=0)
            await page.wait_for(
                "document.getElementById('result').textContent.startsWith('completed')"
            )
            assert await page.text("output") == "".join(f"t{i} " for i in range(20))
            # The key went in the subprotocol, checked before the upgrade was accepted; the
            # login's Basic credentials are not sent on a WebSocket.
            (wire,) = tap.sockets
            assert wire.ends[-1]["reason"] == "completed"
            assert "authorization" not in wire.upgrade
            key_token = base64.urlsafe_b64encode(KEY.encode()).decode().rstrip("=")
            offered = f"llmflow.v1, llmflow.key.{key_token}"
            assert wire.upgrade["sec-websocket-protocol"] == offered

            # The SSE fallback: the same text over fetch, with the key as a Bearer header.
            await page.js("document.getElementById('transport').value = 'sse'")
            await _send(page, 20, delay_ms=0)
            await page.wait_for(
                "document.getElementById('result').textContent.startsWith('completed')"
            )
            assert await page.text("output") == "".join(f"t{i} " for i in range(20))
            assert await page.text("window") == "none (SSE)"
            assert len(tap.sockets) == 1

            # A wrong key: the socket is refused before it opens, and the page says why.
            await page.js("document.getElementById('transport').value = 'websocket'")
            await page.set_value("api-key", "wrong")
            await _send(page, 20, delay_ms=0)
            await page.wait_for("document.getElementById('result').textContent.startsWith('401')")
            assert "invalid_api_key" in await page.text("result")
            assert len(tap.sockets) == 2
            assert tap.sockets[1].sent == 0
            assert h.fake.seen == 2
        finally:
            await asyncio.to_thread(browser.close)


async def test_a_refusal_reaches_the_page_with_its_status_and_retry_after(tmp_path: Path) -> None:
    gateway = start_gateway(
        configure=_fake_plan(itl=0.02),
        gate={"max_concurrency_per_gpu": 1, "queue": {"max_waiting": 0}},
        sla={"ttft_ms": None},
    )
    async with _playground(tmp_path, gateway) as (h, _tap, page):
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
        async with h.client.stream(
            "POST", "/v1/chat/completions", json={**body, "max_tokens": 1000, "stream": True}
        ) as held:
            assert held.status_code == 200
            await until(lambda: h.fake.running == 1)
            await _send(page, 20, delay_ms=0)
            result = await page.wait_for(
                "document.getElementById('result').textContent.startsWith('429')"
                " && document.getElementById('result').textContent"
            )
            refused = await page.js(
                "import('/static/llmflow-client.js').then(({stream}) => stream("
                "{model: 'fake-model', max_tokens: 5, messages: [{role: 'user', content: 'hi'}]})"
                ".then(() => null, (e) => [e.name, e.status, e.code, e.retryAfter]))"
            )
        assert refused[:3] == ["LlmflowError", 429, "queue_full"]
        assert refused[3] >= 1
        assert "queue_full" in result
        assert re.search(r"retry after [1-9][0-9]* s", result), result
        assert h.fake.seen == 1  # neither refusal reached the backend


async def test_a_reply_cut_at_its_deadline_shows_the_notice(tmp_path: Path) -> None:
    gateway = start_gateway(configure=_fake_plan(itl=0.01), timeouts={"total_ms": 800})
    async with _playground(tmp_path, gateway) as (h, tap, page):
        await _send(page, 1000, delay_ms=0)
        result = await page.wait_for(
            "document.getElementById('result').textContent.startsWith('deadline')"
            " && document.getElementById('result').textContent"
        )
        (wire,) = tap.sockets
        assert result == f"deadline · {wire.sent} chunks sent · cut: deadline"
        notice = notice_for("deadline")
        assert wire.text[-1] == notice  # the gateway's last chunk is the notice...
        assert (await page.text("output")).endswith(notice)  # ...and the page drew it
        assert await page.text("output") == "".join(wire.text)
        await until(lambda: h.fake.aborted == 1)


def _cell(key: str) -> str:
    return f"document.querySelector('#server td[data-key={key}]').textContent"


async def test_the_page_shows_the_gateways_view_of_its_request(tmp_path: Path) -> None:
    gateway = start_sim_gateway(backpressure={"client_window": 8})
    async with _playground(tmp_path, gateway) as (h, tap, page):
        await _send(page, 600, delay_ms=120)
        await page.wait_for("Number(document.getElementById('chunks').textContent) >= 15")
        (wire,) = tap.sockets
        await page.wait_for(f"{_cell('backend')} === 'sim0'")
        assert await page.js(_cell("id")) == str(wire.request_id)
        (row,) = h.gateway.state()["core"]["requests"]
        assert row["id"] == wire.request_id
        assert await page.js(_cell("state")) == row["state"]
        shown = int(await page.js(_cell("generated_tokens")))  # an earlier poll: not more
        (now,) = h.gateway.state()["core"]["requests"]
        assert await page.number("chunks") <= shown <= now["generated_tokens"]
        # simserve sends no per-chunk usage: the page says it cannot count tokens
        assert (await page.text("tokens"), await page.text("merged")) == (UNKNOWN, UNKNOWN)
        await page.click("#cancel")
        await page.wait_for("document.getElementById('result').textContent === 'cancelled'")
        await page.wait_for(f"{_cell('state')} === 'ended'")
        await until(lambda: wire.closed)
        assert not h.gateway.state()["core"]["requests"]
