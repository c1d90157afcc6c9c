"""Backend observation: scrape each vLLM's `/metrics` every few hundred ms and feed the core.

Reads KV usage (`vllm:kv_cache_usage_perc`, or `vllm:gpu_cache_usage_perc` from older vLLM),
running and waiting counts, and the preemption counter. A scrape that fails marks the backend
unhealthy once it has failed `FAILURES_BEFORE_UNHEALTHY` times in a row (at once if it never
answered); the next good scrape marks it healthy again. Staleness itself is the core's call: it
knows when each backend was last observed.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from llmflow.gateway.policy import Policy
    from llmflow.gateway.upstream import Upstream

__all__ = ["FAILURES_BEFORE_UNHEALTHY", "BackendState", "Scraper", "parse_vllm_metrics"]

log = logging.getLogger("llmflow.gateway")

FAILURES_BEFORE_UNHEALTHY = 2  # one lost scrape is noise; two in a row is a sick backend
_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # new name first
_SUMMED = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_preemptions_total": "preemptions_total",
}
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(slots=True)
class BackendState:
    """What the gateway last learned about one backend."""

    name: str
    url: str
    healthy: bool = True  # the core starts with every backend healthy
    ever_scraped: bool = False
    failures: int = 0
    kv_usage: float | None = None
    running: int | None = None
    waiting: int | None = None
    preemptions_total: int | None = None
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    scraped_at: float | None = None
    last_error: str | None = None
    scrapes: int = 0
    down_at: float | None = None  # when a request last found it unreachable
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


class Scraper:
    """Scrapes every backend on a fixed period and reports to the core.

    Args:
        policy: the core runtime to feed.
        upstream: the shared HTTP client.
        backends: backend name -> base URL.
        interval_s: time between scrapes of one backend.
    """

    def __init__(
        self,
        policy: Policy,
        upstream: Upstream,
        backends: dict[str, str],
        interval_s: float,
        block_size: int = 16,
    ) -> None:
        self.policy, self.upstream, self.interval_s = policy, upstream, interval_s
        self.block_size = block_size  # the core's KV block (`kv.block_size`); vLLM's may differ
        self.timeout_s = max(0.2, min(2.0, interval_s * 2))
        self.states = {name: BackendState(name, url) for name, url in backends.items()}
        self._task: asyncio.Task[None] | None = None

    async def scrape_all(self) -> None:
        """Scrape every backend once, concurrently."""
        await asyncio.gather(*(self.scrape(name) for name in self.states))

    async def scrape(self, name: str) -> bool:
        """Scrape one backend, feed the core, update its health; True when the scrape worked."""
        state = self.states[name]
        started = time.monotonic()
        try:
            response = await self.upstream.get(state.url + "/metrics", self.timeout_s)
            response.raise_for_status()
            values = parse_vllm_metrics(response.text)
        except httpx.HTTPError as exc:
            state.failures += 1
            state.last_error = repr(exc)
            enough = state.failures >= FAILURES_BEFORE_UNHEALTHY or not state.ever_scraped
            if state.healthy and enough:
                self._set_health(state, False)
            return False
        self._record(state, values, started)
        return True

    def _record(
        self, state: BackendState, values: dict[str, float], started: float | None = None
    ) -> None:
        state.failures, state.last_error, state.scrapes = 0, None, state.scrapes + 1
        state.scraped_at, state.ever_scraped = time.monotonic(), True
        state.kv_usage = values.get("kv_usage")
        state.running = _int(values.get("running"))
        state.waiting = _int(values.get("waiting"))
        state.preemptions_total = _int(values.get("preemptions_total"))
        state.num_gpu_blocks = _int(values.get("num_gpu_blocks"))
        state.block_size = _int(values.get("block_size"))
        kv = None if state.kv_usage is None else min(max(state.kv_usage, 0.0), 1.0)
        self.policy.observe_backend(
            state.name,
            kv_usage=kv,
            running=state.running,
            waiting=state.waiting,
            preemptions_total=state.preemptions_total,
            kv_blocks=_in_core_blocks(state.num_gpu_blocks, state.block_size, self.block_size),
        )
        began = time.monotonic() if started is None else started
        if not state.healthy and (state.down_at is None or began > state.down_at):
            self._set_health(state, True)  # a scrape begun before a request failed proves nothing

    def _set_health(self, state: BackendState, healthy: bool) -> None:
        state.healthy = healthy
        self.policy.set_backend_health(state.name, healthy)
        if healthy:
            log.info("backend %s at %s is healthy", state.name, state.url)
        else:
            log.warning(
                "backend %s at %s is unhealthy: %s", state.name, state.url, state.last_error
            )

    def mark_down(self, name: str, error: str) -> None:
        """A request could not reach the backend: unhealthy now, until a scrape succeeds."""
        state = self.states[name]
        state.last_error, state.down_at = error, time.monotonic()
        if state.healthy:
            self._set_health(state, False)

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
            await self.scrape_all()
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))


def _in_core_blocks(blocks: int | None, size: int | None, core_size: int) -> int | None:
    """vLLM's KV capacity counted in the core's blocks (CPU vLLM has 128-token blocks)."""
    if blocks is None or size is None:
        return blocks
    return blocks * size // core_size


def _int(value: float | None) -> int | None:
    return None if value is None else round(value)
