"""A standing suite backend (`llmflow conformance-backend`), mirrored over HTTP.

The suite reads its backend's counters in tight loops; here they come from a copy refreshed
every 10 ms from `GET /_conformance/state`. The backend's times are on its own monotonic
clock: each refresh maps them onto this process's by the midpoint of the exchange, so a time
is off by at most half a round trip (microseconds on one host).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import httpx

from llmflow.conformance.backend import Record

__all__ = ["RemoteBackend"]

_POLL_S = 0.01  # between refreshes of the mirror


class RemoteBackend:
    """The counters of a suite backend in another process.

    Args:
        url: its base URL (as the gateway under test is configured with it).
    """

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.running = self.peak_running = 0
        self.records: dict[str, list[Record]] = {}
        self._client = httpx.AsyncClient(base_url=self.url, timeout=10.0, trust_env=False)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> RemoteBackend:
        """Forget what the backend saw before this run and start mirroring it.

        Raises:
            httpx.HTTPError: it does not answer as a suite backend.
        """
        response = await self._client.post("/_conformance/reset")
        response.raise_for_status()
        await self._refresh()
        self._task = asyncio.ensure_future(self._poll())
        return self

    async def aclose(self) -> None:
        """Stop mirroring."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._client.aclose()

    def runs(self, tag: str) -> list[Record]:
        """Every request the backend received with `tag`, as of the last refresh."""
        if self._task is not None and self._task.done():
            self._task.result()  # the mirror stopped: say why rather than read stale copies
        return self.records.get(tag, [])

    async def sync(self) -> None:
        """Refresh the mirror now (a refresh a poll started before now may predate a request)."""
        await self._refresh()

    async def next_phase(self) -> int:
        """The peak running since the last call (asked of the backend itself)."""
        response = await self._client.post("/_conformance/next-phase")
        response.raise_for_status()
        await self._refresh()
        return int(response.json()["peak"])

    async def _poll(self) -> None:
        while True:
            # A refresh that fails is retried; a body that is not the backend's state (JSON,
            # keys) would fail every time, and ends the poll with its error (`runs` raises it).
            with contextlib.suppress(httpx.HTTPError):
                await self._refresh()
            await asyncio.sleep(_POLL_S)

    async def _refresh(self) -> None:
        sent = time.monotonic()
        response = await self._client.get("/_conformance/state")
        offset = (sent + time.monotonic()) / 2
        response.raise_for_status()
        state: dict[str, Any] = response.json()
        offset -= float(state["now"])
        self.records = {
            tag: [_record(r, offset) for r in runs] for tag, runs in state["records"].items()
        }
        self.running, self.peak_running = int(state["running"]), int(state["peak_running"])


def _record(raw: dict[str, Any], offset: float) -> Record:
    ended = raw["ended_at"]
    return Record(
        tag=raw["tag"],
        received_at=raw["received_at"] + offset,
        ended_at=None if ended is None else ended + offset,
        outcome=raw["outcome"],
        tokens=raw["tokens"],
        bytes_sent=raw["bytes_sent"],
    )
