"""One replica scrapes each backend at a time; the others read its result from Redis.

With `state: {backend: redis}`, each scrape of a backend first tries to take the backend's
scrape lock (`SET {prefix}:scrape-lock:{backend} NX PX`, for 90% of the scrape interval). The
replica that gets it reads vLLM's `/metrics` and stores what it read, or the failure, with
Redis's own time. The others read that record, and it reaches their runtime as their own scrape
would: `scrape_ok` with the record's age taken off `began`, or `scrape_failed`. So a backend
answers one scrape per interval, not one per replica. When Redis is unreachable, or has no record
yet, a replica scrapes the backend itself.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from llmflow.gateway.shared_state import SharedSlots

__all__ = ["ScrapedElsewhereError", "SharedScrapes", "answered"]

log = logging.getLogger("llmflow.gateway")


class ScrapedElsewhereError(Exception):
    """The replica holding the scrape lock could not scrape the backend.

    Args:
        message: its error.
        reachable: whether the backend answered it (see `answered`).
    """

    def __init__(self, message: str, reachable: bool) -> None:
        super().__init__(message)
        self.reachable = reachable


_AWAY = (502, 503, 504)  # a proxy saying the server behind it is away, or the server itself


def answered(exc: BaseException) -> bool:
    """Whether a failed scrape reached a live server: anything but a connection that could
    not be made or a 502/503/504 (an error status such as 500, a reply that is not metrics,
    a read that timed out, a connection dropped mid-reply). The runtime keeps such a backend
    up, at the stale rule's half of its slots, and takes down only one that nothing answers."""
    if isinstance(exc, ScrapedElsewhereError):
        return exc.reachable
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code not in _AWAY
    return not isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))


class SharedScrapes:
    """Scrapes shared by replicas through the same Redis as the slot leases.

    Args:
        slots: the replica's shared state (its Redis client, key prefix and replica id).
        interval_ms: the scrape interval (`metrics.scrape_interval_ms`).
    """

    def __init__(self, slots: SharedSlots, interval_ms: float) -> None:
        self.slots = slots
        self.client = slots.client
        self.prefix = slots.state.key_prefix
        self.lock_ms = max(int(interval_ms * 0.9), 1)
        self.keep_ms = max(int(interval_ms * 4), 1000)  # a record older than this is not read

    async def fetch(
        self, backend: str, scrape: Callable[[], Awaitable[dict[str, float]]]
    ) -> tuple[dict[str, float], float]:
        """The backend's metrics and their age in seconds: scraped here (age 0) when this
        replica takes the lock, or read from the replica that did.

        Raises:
            ScrapedElsewhereError: the scraping replica recorded a failure.
            httpx.HTTPError, NotMetricsError: this replica scraped, and that failed.
        """
        lock, record = f"{self.prefix}:scrape-lock:{backend}", f"{self.prefix}:scrape:{backend}"
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.set(lock, self.slots.replica, nx=True, px=self.lock_ms)
                pipe.get(record)
                pipe.time()
                mine, raw, (secs, micros) = await pipe.execute()
        except Exception:  # Redis away: scrape ourselves (the leases report the loss)
            return await scrape(), 0.0
        now_ms = secs * 1000 + micros // 1000
        data = _record_of(raw) if not mine and raw is not None else None
        if data is not None:
            if "error" in data:
                raise ScrapedElsewhereError(str(data["error"])[:200], data["reachable"] is True)
            return data["values"], max(now_ms - data["at_ms"], 0) / 1e3
        try:
            values = await scrape()
        except Exception as exc:
            failure = {"error": repr(exc), "reachable": answered(exc), "at_ms": now_ms}
            await self._store(record, failure)
            raise
        await self._store(record, {"values": values, "at_ms": now_ms})
        return values, 0.0

    async def _store(self, record: str, data: dict[str, Any]) -> None:
        """Write a record (ours replaces a garbage one: the next reader finds it sound)."""
        try:
            await self.client.set(record, json.dumps(data), px=self.keep_ms)
        except Exception as exc:  # the others scrape for themselves meanwhile
            log.debug("shared scrape: could not store %s: %s", record, exc)


def _record_of(raw: Any) -> dict[str, Any] | None:
    """A record as another replica stores it, or None for anything else (garbage in Redis is
    no record: this replica scrapes the backend itself, and stores a sound one over it)."""
    try:
        data = json.loads(raw)
    except (TypeError, ValueError, UnicodeDecodeError):
        data = None
    at = data.get("at_ms") if isinstance(data, dict) else None
    if isinstance(at, bool) or not isinstance(at, int):
        log.warning("shared scrape: ignored a record that is not one: %.80r", raw)
        return None
    if "error" in data:
        return {"error": data["error"], "reachable": data.get("reachable"), "at_ms": at}
    if not isinstance(data.get("values"), dict):
        log.warning("shared scrape: ignored a record without values: %.80r", raw)
        return None
    return {"values": data["values"], "at_ms": at}
