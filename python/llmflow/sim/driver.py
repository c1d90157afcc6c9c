"""Real-time engine driver: the engine model stepping on the asyncio clock, for `simserve`.

`RealtimeEngine` runs `EngineCore` steps as an asyncio task, sleeping each step's simulated
duration divided by `speed`. Requests are `Stream`s: after every step each live stream receives
its new tokens (its `generated` count), so a consumer sees tokens at the pace a GPU would emit
them. It also keeps the counters and histograms vLLM exports on `/metrics`, and tells an
`on_end` hook of each sequence that ends or is aborted (`server_pd.py` keeps a P/D
prefill's blocks there).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from bisect import bisect_left
from typing import TYPE_CHECKING

from llmflow.sim.engine import DONE, EngineCore, Seq

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

__all__ = ["Histogram", "RealtimeEngine", "Stream"]

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    """A Prometheus-style histogram: cumulative bucket counts, sum and count.

    Args:
        buckets: upper bounds, increasing (`+Inf` is implied).
    """

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Add one observation."""
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, float]]:
        """`(le, cumulative count)` pairs, `+Inf` last."""
        out, acc = [], 0
        for le, n in zip((*map(str, self.buckets), "+Inf"), self.counts, strict=True):
            acc += n
            out.append((le, float(acc)))
        return out


class Stream:
    """One request in the real-time engine; iterate it for token-count increments."""

    def __init__(self, seq: Seq, arrival: float):
        self.seq = seq
        self.arrival = arrival
        self.sent = 0  # tokens handed to the consumer
        self.finish_reason: str | None = None
        self.first_at: float | None = None
        self._last = arrival
        self._event = asyncio.Event()
        self._pending = 0

    def _push(self, total: int, now: float, itl: Histogram) -> None:
        if total > self.sent + self._pending:
            if self.first_at is not None:
                itl.observe(now - self._last)
            self._last = now
            self._pending = total - self.sent
            self._event.set()

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self._event.set()

    async def __aiter__(self) -> AsyncIterator[int]:
        """Yield how many new tokens arrived, until the request ends."""
        while True:
            await self._event.wait()
            self._event.clear()
            if self._pending:
                n, self._pending = self._pending, 0
                self.sent += n
                yield n
            if self.finish_reason is not None and not self._pending:
                return


class RealtimeEngine:
    """An `EngineCore` stepping in (scaled) wall-clock time.

    Args:
        core: the engine state (its cost model sets each step's duration).
        speed: simulated seconds per wall second (2.0 runs twice as fast as the GPU would).
    """

    def __init__(self, core: EngineCore, speed: float = 1.0):
        if speed <= 0:
            raise ValueError(f"speed must be positive, got {speed}")
        self.core, self.speed = core, speed
        self.streams: dict[int, Stream] = {}
        self._ids = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._t0 = time.monotonic()
        self.requests_success: dict[str, int] = {}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.queue_time = Histogram(E2E_BUCKETS)
        self.prefill_tokens = 0  # tokens the steps prefilled (recomputes in, cache hits out)
        self.on_end: Callable[[Seq], None] | None = None  # told as a stream ends or aborts

    def now(self) -> float:
        """Simulated seconds since start."""
        return (time.monotonic() - self._t0) * self.speed

    async def start(self) -> None:
        """Start stepping (call from the event loop that serves requests)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="llmflow-sim-engine")

    async def stop(self) -> None:
        """Stop stepping and end every live stream as aborted."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for s in list(self.streams.values()):
            self.abort(s)

    def submit(
        self, prompt: int, max_tokens: int, eos_at: int | None, priority: int = 0,
        hash_ids: tuple[int, ...] | None = None, hold_kv: bool = False,
        remote_kv: bool = False,
    ) -> Stream:
        """Queue a request (`hash_ids`: its prompt's block hashes, for the prefix cache;
        `hold_kv`, `remote_kv`: a P/D prefill's or decode's, as `Seq` has them).

        Raises:
            EngineError: longer than `max_model_len`, or empty.
        """
        self._ids += 1
        seq = Seq(self._ids, prompt, max_tokens, eos_at, priority, hash_ids=hash_ids,
                  hash_block=self.core.block_size)
        seq.hold_kv, seq.remote_kv = hold_kv, remote_kv
        now = self.now()
        self.core.add(seq, now)
        stream = Stream(seq, now)
        self.streams[seq.rid] = stream
        self._wake.set()
        return stream

    def kick(self) -> None:
        """Plan a step now: blocks were freed or a remote KV arrived outside a step."""
        self._wake.set()

    def abort(self, stream: Stream) -> None:
        """Abort a request (its client went away): frees its KV blocks."""
        if self.core.abort(stream.seq, self.now()):
            self.streams.pop(stream.seq.rid, None)
            if self.on_end is not None:
                self.on_end(stream.seq)
            stream._finish("abort")

    async def _run(self) -> None:
        core = self.core
        while True:
            dt = core.schedule(self.now())
            if dt is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            self.prefill_tokens += core.step_prefill_tokens
            await asyncio.sleep(dt / self.speed)
            now = self.now()
            first, ended = core.complete(now)
            for seq in first:
                s = self.streams.get(seq.rid)
                if s is not None:
                    s.first_at = now
                    self.ttft.observe(now - s.arrival)
                    self.queue_time.observe(max(0.0, seq.t_sched - s.arrival))
            for s in self.streams.values():
                seq = s.seq
                s._push(seq.gen if seq.state == DONE else core.generated(seq), now, self.itl)
            for seq in ended:
                s = self.streams.pop(seq.rid, None)
                if s is not None:
                    reason = seq.finish_reason
                    self.requests_success[reason] = self.requests_success.get(reason, 0) + 1
                    self.e2e.observe(now - s.arrival)
                    if self.on_end is not None:
                        self.on_end(seq)
                    s._finish(reason)
