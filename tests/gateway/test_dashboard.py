"""The dashboard's page in Debian's headless chromium, fed a snapshot by a tiny server.

The page is the gateway's own (`PAGE`), served unchanged beside a `/api/state` the test holds
still: a real gateway's (in front of a fake vLLM), or one with a thousand requests in flight made
by the real core (`busy_state`). The browser is driven over the DevTools protocol
(`browser.py`): what is checked is what it rendered, and clicks are real mouse clicks.
`test_dashboard_browser.py` watches the page live.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest

from .browser import Browser
from .busy_state import StateServer, busy_state
from .harness import Harness, until

if TYPE_CHECKING:
    from pathlib import Path

ROWS = "[...document.querySelectorAll('#requests tr[data-id]')]"
IDS = f"{ROWS}.map(tr => Number(tr.dataset.id))"


def _column(key: str) -> str:
    return f"{ROWS}.map(tr => tr.querySelector('td[data-key={key}]').textContent)"


def _render(state: dict[str, Any], tmp_path: Path, script: str) -> Any:
    with StateServer(state) as server, Browser(tmp_path) as page:
        page.goto(f"{server.url}/dashboard")
        page.wait_for("document.getElementById('count').textContent")
        return page.evaluate(script)


@pytest.mark.anyio
async def test_a_real_snapshot_renders_backends_queue_and_requests(
    gw: Harness, tmp_path: Path
) -> None:
    gw.fake.default = {"step": True}
    task = asyncio.create_task(
        gw.client.post(
            "/v1/chat/completions",
            json={
                "model": "fake-model",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            },
        )
    )
    await until(lambda: gw.fake.running == 1)
    state = (await gw.client.get("/api/state")).json()
    gw.fake.release(2)
    await task
    (request,) = state["core"]["requests"]
    script = """({
      status: document.getElementById('status').textContent,
      backends: document.getElementById('backends').innerHTML,
      queue: document.getElementById('queue').innerHTML,
      headers: [...document.querySelectorAll('#columns th')].map(th => th.dataset.key),
      row: Object.fromEntries([...document.querySelectorAll('#requests tr[data-id] td')]
        .map(td => [td.dataset.key, td.textContent])),
    })"""
    html = await asyncio.to_thread(_render, state, tmp_path, script)
    assert "running 1" in html["status"]
    assert "<b>b0</b>" in html["backends"]
    assert '<span class="ok">healthy</span>' in html["backends"]
    assert "<b>normal</b>: 0" in html["queue"]
    row = html["row"]
    assert (row["tenant"], row["tier"], row["backend"]) == ("anonymous", "normal", "b0")
    assert row["priority"] == str(request["priority"])
    assert row["kv_blocks"] == str(request["kv_blocks"])
    # No request in today's snapshot carries a model or prefix hits: no empty columns for them.
    assert "prefix_hit_blocks" not in html["headers"]
    assert "model" not in html["headers"]


def test_a_thousand_requests_render_a_screenful_of_reused_rows_and_sort_on_click(
    tmp_path: Path, record_property: Any
) -> None:
    state = busy_state(1000)
    assert state["core"]["running"] == 1000
    requests = state["core"]["requests"]
    with StateServer(state) as server, Browser(tmp_path) as page:
        page.goto(f"{server.url}/dashboard")
        page.wait_for(f"document.getElementById('count').textContent === '({len(requests):,})'")

        # Only what can be seen is in the DOM, largest KV first.
        ids = page.evaluate(IDS)
        assert 20 <= len(ids) <= 100, len(ids)
        by_kv = sorted(requests, key=lambda r: (-r["kv_blocks"], r["id"]))
        assert ids == [r["id"] for r in by_kv[: len(ids)]]

        # The time to render one snapshot (script, style and layout), recorded, not asserted:
        # docs/benchmarks.md has the figures and benchmarks/dashboard_bench.py the command.
        timings = page.evaluate(
            "(async () => { const s = await (await fetch('api/state')).json(); const ms = [];"
            " for (let i = 0; i < 5; i++) { s.uptime_s += 1; const t = performance.now();"
            " render(s); document.body.getBoundingClientRect();"
            " ms.push(performance.now() - t); } return ms; })()"
        )
        record_property("render_1000_ms", timings)
        print(f"render of 1,000 requests, ms: {[round(t, 1) for t in timings]}")

        # The rows are the same nodes after a poll: refilled, not rebuilt.
        page.evaluate("document.querySelector('#requests tr[data-id]').mark = 'kept'")
        uptime = page.evaluate("ring[ring.length - 1].t")
        page.wait_for(f"ring[ring.length - 1].t > {uptime}")
        assert page.evaluate("document.querySelector('#requests tr[data-id]').mark") == "kept"

        # A click on a header sorts by it, a second click reverses.
        page.click("th[data-key=id]")
        assert page.wait_for(f"{IDS}[0] === {max(r['id'] for r in requests)}")
        page.click("th[data-key=id]")
        assert page.wait_for(f"{IDS}[0] === 1")
        assert page.evaluate(IDS) == sorted(page.evaluate(IDS))
        page.click("th[data-key=tenant]")
        tenants = page.wait_for(f"{_column('tenant')}[0] === 'acme' && {_column('tenant')}")
        assert tenants == sorted(tenants)
        assert page.evaluate("document.querySelector('th[aria-sort=ascending]').dataset.key") == (
            "tenant"
        )

        # From the keyboard: a focused header sorts on Enter.
        page.evaluate("document.querySelector('th[data-key=prompt_tokens]').focus()")
        page.press_enter()
        longest = max(r["prompt_tokens"] for r in requests)
        assert page.wait_for(f"{_column('prompt_tokens')}[0] === '{longest}'")

        # The last row is reachable: scrolled to the bottom, the page shows the end of the order.
        page.evaluate("document.getElementById('scroller').scrollTop = 1e9")
        last = sorted(requests, key=lambda r: (-r["prompt_tokens"], r["id"]))[-1]["id"]
        assert page.wait_for(f"{IDS}.includes({last}) && {IDS}.at(-1)") == last
        assert len(page.evaluate(IDS)) <= 100


def test_columns_the_core_does_not_send_yet_appear_when_it_does(tmp_path: Path) -> None:
    """Prefix-aware routing is to put each request's model and prefix hits (in blocks) in the
    snapshot; the page shows those columns as soon as any request carries them."""
    state = busy_state(10, queued=0)
    for n, request in enumerate(state["core"]["requests"]):
        request["model"] = "llama"
        request["prefix_hit_blocks"] = n
    script = """[[...document.querySelectorAll('#columns th')].map(th => th.dataset.key),
      [...document.querySelectorAll('#requests tr[data-id]')].map(tr =>
        tr.querySelector('td[data-key=prefix_hit_blocks]').textContent)]"""
    headers, hits = _render(state, tmp_path, script)
    assert {"model", "prefix_hit_blocks"} <= set(headers)
    assert sorted(map(int, hits)) == list(range(len(state["core"]["requests"])))


def test_the_charts_keep_ten_minutes_in_the_page(tmp_path: Path) -> None:
    """The ring lives in the browser: samples older than 600 s (by the gateway's uptime) go."""
    with StateServer(busy_state(10, queued=0)) as server, Browser(tmp_path) as page:
        page.goto(f"{server.url}/dashboard")
        page.wait_for("ring.length >= 1")
        kept = page.evaluate(
            "(async () => { const s = await (await fetch('api/state')).json();"
            " const t0 = Math.ceil(ring[ring.length - 1].t) + 1;"
            " for (let i = 0; i < 700; i++) { s.uptime_s = t0 + i; addSample(s); }"
            " drawCharts();"
            " return [ring.length, ring[ring.length - 1].t - ring[0].t,"
            "  Number(document.querySelector('path[data-series=b0]').dataset.points)]; })()"
        )
    length, span, points = kept
    assert (length, span, points) == (601, 600, 601)
