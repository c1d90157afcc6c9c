"""Debian's headless chromium, driven over the DevTools protocol (CDP) on a websocket.

What a test reads is the page as the browser rendered it, any number of times while it lives
(`evaluate`), and what it does is what a user does: a real mouse click at an element's place on
the screen (`click`), a scroll. `.ci/run` installs chromium; the dashboard tests and
`benchmarks/dashboard_bench.py` use this.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from typing import TYPE_CHECKING, Any

import httpx
from websockets.sync.client import connect

from tests.processes import own_process_group

if TYPE_CHECKING:
    from pathlib import Path
    from types import TracebackType

__all__ = ["CHROMIUM", "Browser"]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """One headless chromium with one page.

    Args:
        workdir: its profile and HOME (chromium writes there).
        width, height: the window, CSS pixels.
    """

    def __init__(self, workdir: Path, width: int = 1280, height: int = 900) -> None:
        assert CHROMIUM, "chromium is required (.ci/run installs Debian's chromium)"
        profile = workdir / "chromium-profile"
        profile.mkdir(parents=True, exist_ok=True)
        (profile / "DevToolsActivePort").unlink(missing_ok=True)  # a reused profile's old port
        self.process = subprocess.Popen(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                f"--user-data-dir={profile}",
                "--remote-debugging-port=0",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "HOME": str(workdir)},
            **own_process_group(),
        )
        self._ids = itertools.count(1)
        self._stack = contextlib.ExitStack()  # websockets wants its connection in a `with`
        try:
            port = self._port(profile / "DevToolsActivePort")
            targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
            page = next(t for t in targets if t["type"] == "page")
            self.ws = self._stack.enter_context(
                connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=30)
            )
        except BaseException:
            self.close()
            raise

    def _port(self, active: Path) -> int:
        deadline = time.monotonic() + 60
        while True:  # chromium writes its port here once it listens
            with contextlib.suppress(OSError, ValueError, IndexError):
                return int(active.read_text().splitlines()[0])
            assert self.process.poll() is None, "chromium exited during startup"
            assert time.monotonic() < deadline, "chromium did not open its DevTools port"
            time.sleep(0.05)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One CDP command; its result (events that arrive meanwhile are dropped)."""
        ident = next(self._ids)
        self.ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=60))
            if message.get("id") == ident:
                assert "error" not in message, f"{method}: {message['error']}"
                result: dict[str, Any] = message["result"]
                return result

    def goto(self, url: str) -> None:
        """Load `url` and wait for its scripts to have run."""
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        reply = self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in reply:
            raise AssertionError(f"{expression}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 20.0) -> Any:
        """Poll `expression` until it is truthy; its value. Fails the test after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            assert time.monotonic() < deadline, f"not reached in {timeout_s} s: {expression}"
            time.sleep(0.1)

    def click(self, selector: str) -> None:
        """A left click with the mouse, at the middle of the element `selector` names."""
        box = self.evaluate(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
            " e.scrollIntoView({block: 'nearest'}); const r = e.getBoundingClientRect();"
            " return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        x, y = box
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def press_enter(self) -> None:
        """The Enter key, typed on the keyboard to the element that has the focus."""
        for kind in ("keyDown", "keyUp"):
            self.call(
                "Input.dispatchKeyEvent",
                type=kind,
                key="Enter",
                code="Enter",
                windowsVirtualKeyCode=13,
            )

    def screenshot(self, path: Path) -> None:
        """The whole page as a PNG."""
        shot = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(shot["data"]))

    def close(self) -> None:
        """Close the connection and stop chromium (its whole process group)."""
        with contextlib.suppress(Exception):
            self._stack.close()
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def __enter__(self) -> Browser:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
