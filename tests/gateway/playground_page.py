"""The playground page in chromium, driven from a test's event loop.

`Page` runs each DevTools call of a `Browser` in a thread, so what lives in the test's loop (the
gateway, the fake vLLM, the WebSocket tap) keeps running while the browser works, and reads the
page as a user sees it: an element's text, a control's value, the page's JS heap. `log_in`
answers the HTTP Basic prompt a browser shows for a page behind an API key.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .browser import Browser

__all__ = ["Page", "log_in"]


class Page:
    """A `Browser` driven from the test's event loop: each call runs in a thread, so the
    gateway, the fake vLLM and the tap (all in this loop) keep running meanwhile."""

    def __init__(self, browser: Browser) -> None:
        self.browser = browser

    async def js(self, expression: str) -> Any:
        return await asyncio.to_thread(self.browser.evaluate, expression)

    async def wait_for(self, expression: str, timeout_s: float = 30.0) -> Any:
        return await asyncio.to_thread(self.browser.wait_for, expression, timeout_s)

    async def click(self, selector: str) -> None:
        await asyncio.to_thread(self.browser.click, selector)

    async def text(self, element: str) -> str:
        return str(await self.js(f"document.getElementById({element!r}).textContent"))

    async def number(self, element: str) -> int:
        return int(await self.text(element))

    async def set_value(self, element: str, value: object) -> None:
        """Set a control as the user would leave it, and tell the page (an `input` event)."""
        await self.js(
            f"(() => {{ const e = document.getElementById({element!r});"
            f" e.value = {json.dumps(value)}; e.dispatchEvent(new Event('input')); }})()"
        )

    async def heap(self) -> int:
        """The page's used JS heap after a full garbage collection (bytes, as V8 counts)."""
        await asyncio.to_thread(self.browser.call, "HeapProfiler.collectGarbage")
        usage = await asyncio.to_thread(self.browser.call, "Runtime.getHeapUsage")
        return int(usage["usedSize"])

    async def rendered_digest(self) -> str:
        return str(
            await self.js(
                "crypto.subtle.digest('SHA-256', new TextEncoder().encode("
                "document.getElementById('output').textContent)).then(d =>"
                " [...new Uint8Array(d)].map(b => b.toString(16).padStart(2, '0')).join(''))"
            )
        )


def log_in(browser: Browser, url: str, password: str) -> None:
    """Load `url`, answering the browser's login prompt (HTTP Basic) as a user would."""
    ids = itertools.count(10**6)
    browser.call("Page.enable")
    browser.call("Fetch.enable", handleAuthRequests=True)
    browser.ws.send(
        json.dumps({"id": next(ids), "method": "Page.navigate", "params": {"url": url}})
    )
    prompted = False
    while True:
        message = json.loads(browser.ws.recv(timeout=30))
        method, params = message.get("method"), message.get("params", {})
        if method == "Fetch.requestPaused":
            reply = {
                "method": "Fetch.continueRequest",
                "params": {"requestId": params["requestId"]},
            }
        elif method == "Fetch.authRequired":
            prompted = True
            answer = {"response": "ProvideCredentials", "username": "user", "password": password}
            reply = {
                "method": "Fetch.continueWithAuth",
                "params": {"requestId": params["requestId"], "authChallengeResponse": answer},
            }
        elif method == "Page.loadEventFired":
            break
        else:
            continue
        browser.ws.send(json.dumps({"id": next(ids), **reply}))
    browser.call("Fetch.disable")
    assert prompted, "the page was served without asking for the key"
