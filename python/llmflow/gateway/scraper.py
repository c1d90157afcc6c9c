"""Backend observation: scrape each vLLM's `/metrics` every few hundred ms and feed the core.

Reads KV usage (`vllm:kv_cache_usage_perc`, or `vllm:gpu_cache_usage_perc` from older vLLM),
running and waiting counts, and the preemption counter, and reports each scrape (or its failure)
to the runtime. Health and staleness are the runtime's call: it marks a backend down after
scrapes that nothing answered or a request that could not reach it, and up again after a good
scrape begun later; a backend that answers without usable metrics stays up, at the stale rule's
half of its slots. This module only says which failure it was, and shows what the runtime said.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx

from llmflow.gateway.host import now_us
from llmflow.gateway.shared_scrape import ScrapedElsewhereError, answered

if TYPE_CHECKING:
    from llmflow.gateway.host import Host
    from llmflow.gateway.shared_scrape import SharedScrapes
    from llmflow.gateway.upstream import Upstream

__all__ = ["BackendState", "NotMetricsError", "Scraper", "parse_vllm_metrics", "sane_metrics"]

log = logging.getLogger("llmflow.gateway")

_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # new name first
_SUMMED = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_preemptions_total": "preemptions_total",
    "vllm:prefix_cache_queries_total": "prefix_queries_total",
    "vllm:prefix_cache_hits_total": "prefix_hits_total",
}
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_KNOWN = ("kv_usage", *_SUMMED.values(), "num_gpu_blocks", "block_size")
_MAX_COUNT = 2.0**53  # past this a float no longer counts whole requests, tokens or blocks


@dataclass(slots=True)
class BackendState:
    """What the gateway last learned about one backend."""

    name: str
    url: str
    healthy: bool = True  # as the runtime last said (it starts with every backend healthy)
    failures: int = 0  # failed scrapes in a row
    kv_usage: float | None = None
    running: int | None = None
    waiting: int | None = None
    preemptions_total: int | None = None
    prefix_queries_total: int | None = None  # prompt tokens vLLM looked up in its prefix cache
    prefix_hits_total: int | None = None  # of those, found cached
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    scraped_at: float | None = None
    last_error: str | None = None
    scrapes: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    def as_json(self) -> dict[str, object]:
        """The state for `/api/state`."""
        age = None if self.scraped_at is None else round(time.monotonic() - self.scraped_at, 3)
        return {
            "url": self.url,
            "healthy": self.healthy,
            "kv_usage": self.kv_usage,
            "running": self.running,
            "waiting": self.waiting,
            "preemptions_total": self.preemptions_total,
            "prefix_queries_total": self.prefix_queries_total,
            "prefix_hits_total": self.prefix_hits_total,
            "num_gpu_blocks": self.num_gpu_blocks,
            "block_size": self.block_size,
            "scrape_age_s": age,
            "failures": self.failures,
            "last_error": self.last_error,
        }


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """Pick vLLM's gauges and counters out of a Prometheus text exposition.

    Returns:
        `kv_usage` (max over engines), `running`, `waiting`, `preemptions_total` (summed), and
        `num_gpu_blocks` / `block_size` from `vllm:cache_config_info`; absent names are left out.
    """
    kv: dict[str, float] = {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        brace = line.find("{")
        name_end = brace if brace >= 0 else line.find(" ")
        name = line[:name_end]
        rest = line[line.rfind("}") + 1 :] if brace >= 0 else line[name_end:]
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if name in _KV:
            kv[name] = max(kv.get(name, 0.0), value)
        elif name in _SUMMED:
            out[_SUMMED[name]] = out.get(_SUMMED[name], 0.0) + value
        elif name == "vllm:cache_config_info" and brace >= 0:
            labels = dict(_LABEL.findall(line[brace : line.rfind("}")]))
            for key in ("num_gpu_blocks", "block_size"):
                if labels.get(key, "").isdigit():
                    out[key] = float(labels[key])
    for name in _KV:
        if name in kv:
            out["kv_usage"] = kv[name]
            break
    return out


def sane_metrics(values: object) -> dict[str, float]:
    """The values a runtime may be fed: each known one finite, a count in [0, 2^53], KV usage
    in [0, 1]; anything else (NaN, a negative gauge, 1e300, a string from a garbage Redis
    record) is dropped as if the page had not said it, so one bad line costs that line only.
    """
    if not isinstance(values, dict):
        return {}
    out: dict[str, float] = {}
    for key in _KNOWN:
        value = values.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        value = float(value)
        top = 1.0 if key == "kv_usage" else _MAX_COUNT
        if math.isfinite(value) and 0.0 <= value <= top:
            out[key] = value
    return out


class NotMetricsError(Exception):
    """A `/metrics` reply without a single vLLM metric in it (a proxy's page, garbage)."""

    def __init__(self, text: str) -> None:
        super().__init__(f"no vLLM metrics in the reply: {text[:80]!r}")


class Scraper:
    """Scrapes every backend on a fixed period and reports to the runtime.

    Args:
        host: the runtime host to feed.
        upstream: the shared HTTP client.
        backends: backend name -> base URL.
        interval_s: time between scrapes of one backend.
        block_size: the core's KV block (`kv.block_size`); vLLM's may differ.
    """

    def __init__(
        self,
        host: Host,
        upstream: Upstream,
        backends: dict[str, str],
        interval_s: float,
        block_size: int = 16,
    ) -> None:
        self.host, self.upstream, self.interval_s = host, upstream, interval_s
        self.block_size = block_size
        self.timeout_s = max(0.2, min(2.0, interval_s * 2))
        self.states = {name: BackendState(name, url) for name, url in backends.items()}
        self._task: asyncio.Task[None] | None = None
        # With replicas sharing Redis: one scrapes each backend, the others read (None: alone).
        self.shared: SharedScrapes | None = None
        host.on_health = self._on_health

    async def scrape_all(self) -> None:
        """Scrape every backend once, concurrently."""
        await asyncio.gather(*(self.scrape(name) for name in self.states))

    async def scrape(self, name: str) -> bool:
        """Scrape one backend and report it to the runtime; True when the scrape worked."""
        state = self.states[name]
        began = now_us()
        try:
            if self.shared is None:
                values = await self._read(state)
            else:
                values, age_s = await self.shared.fetch(name, lambda: self._read(state))
                began -= round(age_s * 1e6)  # read by another replica that long ago
            values = sane_metrics(values)
            if not values:
                raise NotMetricsError("no value a runtime can use (NaN, negative, too large)")
        except (httpx.HTTPError, NotMetricsError, ScrapedElsewhereError) as exc:
            self._failed(state, exc, answered(exc))
            return False
        except Exception as exc:  # contained to this backend's scrape: the loop goes on
            log.exception("scrape of %s at %s failed", name, state.url)
            self._failed(state, exc, reachable=True)
            return False
        self._record(state, values, began)
        return True

    def _failed(self, state: BackendState, exc: BaseException, reachable: bool) -> None:
        state.last_error = repr(exc)[:200]
        self.host.scrape_failed(state.name, reachable=reachable)
        state.failures = self.host.runtime.scrape_failures(state.name)

    async def _read(self, state: BackendState) -> dict[str, float]:
        response = await self.upstream.get(state.url + "/metrics", self.timeout_s)
        response.raise_for_status()
        values = parse_vllm_metrics(response.text)
        if not values:  # a 200 that says nothing is no observation: not a fresh scrape
            raise NotMetricsError(response.text)
        return values

    def _record(self, state: BackendState, values: dict[str, float], began: int) -> None:
        state.failures, state.last_error, state.scrapes = 0, None, state.scrapes + 1
        state.scraped_at = time.monotonic()
        state.kv_usage = values.get("kv_usage")
        state.running = _int(values.get("running"))
        state.waiting = _int(values.get("waiting"))
        state.preemptions_total = _int(values.get("preemptions_total"))
        state.prefix_queries_total = _int(values.get("prefix_queries_total"))
        state.prefix_hits_total = _int(values.get("prefix_hits_total"))
        state.num_gpu_blocks = _int(values.get("num_gpu_blocks"))
        state.block_size = _int(values.get("block_size"))
        self.host.scrape_ok(
            state.name,
            began,
            kv_usage=state.kv_usage,
            running=state.running,
            waiting=state.waiting,
            preemptions_total=state.preemptions_total,
            kv_blocks=_in_core_blocks(state.num_gpu_blocks, state.block_size, self.block_size),
        )

    def _on_health(self, backend: str, healthy: bool) -> None:
        state = self.states[backend]
        state.healthy = healthy
        if healthy:
            log.info("backend %s at %s is healthy", state.name, state.url)
        else:
            log.warning(
                "backend %s at %s is unhealthy: %s", state.name, state.url, state.last_error
            )

    def start(self, tasks: set[asyncio.Task[None]]) -> None:
        """Start the periodic scrape loop as a background task."""
        self._task = asyncio.create_task(self._run(), name="llmflow-scraper")
        tasks.add(self._task)
        self._task.add_done_callback(tasks.discard)

    async def stop(self) -> None:
        """Stop the scrape loop."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.scrape_all()
            except Exception:  # never the loop: health and staleness must keep moving
                log.exception("scrape round failed")
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))


def _in_core_blocks(blocks: int | None, size: int | None, core_size: int) -> int | None:
    """vLLM's KV capacity counted in the core's blocks (CPU vLLM has 128-token blocks)."""
    if blocks is None or size is None:
        return blocks
    return blocks * size // core_size


def _int(value: float | None) -> int | None:
    return None if value is None else round(value)
