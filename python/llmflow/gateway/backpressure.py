"""The bounded window between a stream's upstream reader and its client writer.

At most `client_window` chunks wait between the two. When the window is full and
`pause_when_full` is set, the reader stops reading upstream until the writer takes chunks (TCP
then pushes back on the backend). Without it, the reader keeps draining the backend (so its slot
and KV are freed sooner) and merges overflow into the newest waiting chunk, so the number of
chunks stays bounded and the text held is bounded by the request's `max_tokens`.

The window reports when it fills up and when it has room again (`on_full`, `on_drained`): the
session passes both to the runtime, whose stall timer ends a client that stays full too long.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING

from llmflow.gateway.streaming import merge_chunks

if TYPE_CHECKING:
    from collections.abc import Callable

    from llmflow.gateway.streaming import Item


def _nothing() -> None:
    pass

__all__ = ["ChunkWindow"]


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
        self.on_full: Callable[[], None] = _nothing  # the window just filled up
        self.on_drained: Callable[[], None] = _nothing  # a full window just got room again
        self._full = False

    def __len__(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        """True once the producer has finished."""
        return self._closed

    async def put(self, chunk: Item) -> None:
        """Add a chunk; waits for room when full and pausing (the producer's backpressure).

        A chunk put after the window closed (a cut's tail is already the last) is dropped.
        """
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
        if self._closed:
            return
        self._items.append(chunk)
        size = len(self._items)
        if size > self.high_water:
            self.high_water = size
        if size >= self.capacity and not self._full:
            self._full = True
            self.on_full()
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
        if self._full and items:
            self._full = False
            self.on_drained()
        _wake(self._putter)
        return items


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)
