"""The dashboard's script renders a real `/api/state` snapshot (run under Node when present)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from typing import TYPE_CHECKING

import pytest

from llmflow.gateway.dashboard import PAGE

from .harness import Harness, until

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.anyio

_DRIVER = """
const fs = require("fs");
const els = {};
global.document = {getElementById: (id) => (els[id] = els[id] || {innerHTML: "", textContent: ""})};
global.fetch = async () => ({json: async () => ({})});
global.setTimeout = () => {};
eval(fs.readFileSync(process.argv[2], "utf8").replace("poll();", ""));
render(JSON.parse(fs.readFileSync(process.argv[3], "utf8")));
const html = Object.entries(els).map(([k, v]) => [k, v.innerHTML]);
console.log(JSON.stringify(Object.fromEntries(html)));
"""


async def test_the_page_renders_backends_queue_and_requests(gw: Harness, tmp_path: Path) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
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
    (tmp_path / "state.json").write_text((await gw.client.get("/api/state")).text)
    gw.fake.release(2)
    await task
    (tmp_path / "page.js").write_text(PAGE.split("<script>")[1].split("</script>")[0])
    (tmp_path / "driver.js").write_text(_DRIVER)
    out = subprocess.run(
        [
            node,
            str(tmp_path / "driver.js"),
            str(tmp_path / "page.js"),
            str(tmp_path / "state.json"),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    html = json.loads(out.stdout)
    assert "running 1" in html["status"]
    assert "<b>b0</b>" in html["backends"]
    assert "healthy" in html["backends"]
    assert "<b>normal</b>: 0" in html["queue"]
    assert "<td>anonymous</td><td>normal</td><td>b0</td>" in html["requests"]
