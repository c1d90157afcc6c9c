"""The dashboard's script renders a real `/api/state` snapshot, in Debian's headless chromium.

The page is the gateway's own (`PAGE`), loaded from a file with `fetch` answering the snapshot,
so what is checked is exactly what the script puts in each element, without a live server.
`.ci/run` installs chromium; `test_dashboard_browser.py` renders the page live.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import subprocess
from typing import TYPE_CHECKING

import pytest

from llmflow.gateway.dashboard import PAGE

from .harness import Harness, until

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.anyio

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

# Before the page's script: `fetch` answers the snapshot (STATE). After it: once the first poll
# has rendered, the title carries each element's innerHTML as base64 JSON (no HTML escaping).
_STUB = "<script>window.fetch = async () => ({json: async () => (STATE)});</script>\n<script>"
_REPORT = """<script>
setTimeout(() => {
  const html = {};
  for (const id of ["status", "backends", "queue", "requests"])
    html[id] = document.getElementById(id).innerHTML;
  document.title = btoa(unescape(encodeURIComponent(JSON.stringify(html))));
}, 100);
</script></body>"""


def _render(state: str, tmp_path: Path) -> dict[str, str]:
    assert CHROMIUM, "chromium is required for this test (.ci/run installs Debian's chromium)"
    assert PAGE.count("<script>") == 1
    assert PAGE.count("</body>") == 1
    page = PAGE.replace("<script>", _STUB.replace("STATE", state)).replace("</body>", _REPORT)
    (tmp_path / "page.html").write_text(page, encoding="utf-8")
    dom = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=2000",
            "--dump-dom",
            (tmp_path / "page.html").as_uri(),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=90,
        env={**os.environ, "HOME": str(tmp_path)},
    ).stdout
    title = re.search(r"<title>([A-Za-z0-9+/=]+)</title>", dom)
    assert title, dom[:2000]
    html: dict[str, str] = json.loads(base64.b64decode(title.group(1)).decode())
    return html


async def test_the_page_renders_backends_queue_and_requests(gw: Harness, tmp_path: Path) -> None:
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
    state = (await gw.client.get("/api/state")).text
    gw.fake.release(2)
    await task
    html = await asyncio.to_thread(_render, state, tmp_path)
    assert "running 1" in html["status"]
    assert "<b>b0</b>" in html["backends"]
    assert '<span class="ok">healthy</span>' in html["backends"]
    assert "<b>normal</b>: 0" in html["queue"]
    assert "<td>anonymous</td><td>normal</td><td>b0</td>" in html["requests"]
