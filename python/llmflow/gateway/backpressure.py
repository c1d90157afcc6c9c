"""The bounded window between a stream's upstream reader and its client writer.

At most `client_window` chunks wait between the two. When the window is full and
`pause_when_full` is set, the reader stops reading upstream until the writer takes chunks (TCP
then pushes back on the backend). Without it, the reader keeps draining the backend (so its slot
and KV are freed sooner) and merges overflow into the newest waiting chunk, so the number of
chunks stays bounded and the text held is bounded by the request's `max_tokens`.

`StallWatch` notices a client that has not taken a write for `stall_timeout`: one loop timer per
stream, re-armed lazily, so the per-chunk path only stores a timestamp.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING

from llmflow.gateway.streaming import merge_chunks

if TYPE_CHECKING:
    from collections.abc import Callable

    from llmflow.gateway.streaming import Item

__all__ = ["ChunkWindow", "StallWatch"]


class ChunkWindow:
    """A bounded FIFO of chunks with one producer and one consumer.

    Args:
        capacity: the most chunks waiting (`backpressure.client_window`).
        pause_when_full: block the producer when full (else merge into the newest chunk).
    """

    def __init__(self, capacity: int, pause_when_full: bool) -> None:
        self.capacity = capacity
        self.pause_when_full = pause_when_full
        self._items: deque[Item] = deque()
        self._closed = False
        self._getter: asyncio.Future[None] | None = None
        self._putter: asyncio.Future[None] | None = None
        self.pauses = 0  # times the producer had to wait for room
        self.high_water = 0  # most chunks ever waiting

    def __len__(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        """True once the producer has finished."""
        return self._closed

    async def put(self, chunk: Item) -> None:
        """Add a chunk; waits for room when full and pausing (the producer's backpressure)."""
        while len(self._items) >= self.capacity and not self._closed:
            if not self.pause_when_full:
                merged = merge_chunks([self._items[-1], chunk])
                if len(merged) == 1:  # merged into the newest waiting chunk
                    self._items[-1] = merged[0]
                    return
            self.pauses += 1
            self._putter = asyncio.get_running_loop().create_future()
            try:
                await self._putter
            finally:
                self._putter = None
        self._items.append(chunk)
        self.high_water = max(self.high_water, len(self._items))
        _wake(self._getter)

    def put_final(self, chunk: Item) -> None:
        """Add the closing chunk (a truncation tail or an error) past the bound, then close."""
        self._items.append(chunk)
        self.close()

    def close(self) -> None:
        """No more chunks will come; the consumer drains what is left, then sees the end."""
        self._closed = True
        _wake(self._getter)
        _wake(self._putter)

    async def take(self) -> list[Item]:
        """Every waiting chunk, oldest first; waits while empty. `[]` means the stream ended."""
        while not self._items:
            if self._closed:
                return []
            self._getter = asyncio.get_running_loop().create_future()
            try:
                await self._getter
            finally:
                self._getter = None
        return self.take_nowait()

    def take_nowait(self) -> list[Item]:
        """Every waiting chunk without waiting (possibly none)."""
        items = list(self._items)
        self._items.clear()
        _wake(self._putter)
        return items


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class StallWatch:
    """Calls `on_stall` when one write to the client has been pending for `timeout_s`.

    Args:
        timeout_s: how long a single write may block.
        on_stall: called once, from the event loop, when it does.
    """

    def __init__(self, timeout_s: float, on_stall: Callable[[], None]) -> None:
        self.timeout_s = timeout_s
        self._on_stall = on_stall
        self._busy_since: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.stalled = False

    def writing(self) -> None:
        """A write to the client starts."""
        self._busy_since = time.monotonic()
        if self._timer is None and not self.stalled:
            self._timer = asyncio.get_running_loop().call_later(self.timeout_s, self._check)

    def written(self) -> None:
        """The write finished (the client took it)."""
        self._busy_since = None

    def cancel(self) -> None:
        """Stop watching (the stream ended)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        if self._busy_since is None:
            return
        waited = time.monotonic() - self._busy_since
        if waited >= self.timeout_s:
            self.stalled = True
            self._on_stall()
        else:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.timeout_s - waited, self._check)
