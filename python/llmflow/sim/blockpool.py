"""vLLM V1's free block queue, in runs: which freed KV blocks are evicted first.

vLLM V1 keeps every free block in one queue (`FreeKVCacheBlockQueue`, `vllm/v1/core/
block_pool.py`). A new block is taken from its head; freed blocks go to its tail, a request's in
reverse order (`SingleTypeKVCacheManager.free`: "the tail blocks are freed first"). With prefix
caching (on by default) a freed full block keeps its hash until it is taken from the head, so a
preempted request that is scheduled again finds the prefix of its own blocks still cached and
recomputes only what was evicted. A cache hit takes its blocks out of the middle of the queue.

The simulator needs no block identities for that: `FreeBlockQueue` holds runs of blocks in queue
order, each either anonymous (never used, or freed by a request that ended) or the full blocks a
preempted request left behind. Taking from the head shrinks the first runs; the blocks of a
preempted request that survive are always its first ones (its last ones were queued first).
"""

from __future__ import annotations

from collections import deque
from typing import Any

__all__ = ["FreeBlockQueue", "Run"]


class Run:
    """Consecutive free blocks in the queue; `owner` is the preempted request they hold a prefix
    of (None: anonymous)."""

    __slots__ = ("n", "owner")

    def __init__(self, n: int, owner: Any = None):
        self.n, self.owner = n, owner


class FreeBlockQueue:
    """The free blocks of one engine, as runs in eviction order.

    Args:
        blocks: free blocks at start (all of them).
    """

    __slots__ = ("_runs", "free")

    def __init__(self, blocks: int):
        self._runs: deque[Run] = deque([Run(blocks)]) if blocks > 0 else deque()
        self.free = blocks  # blocks in the queue, cached ones included

    def push(self, n: int, owner: Any = None) -> Run | None:
        """Queue `n` freed blocks at the tail.

        Returns:
            The new run when `owner` is given (its survivors are `run.n`), else None.
        """
        if n <= 0:
            return None
        self.free += n
        runs = self._runs
        if owner is None and runs and runs[-1].owner is None:
            runs[-1].n += n
            return None
        run = Run(n, owner)
        runs.append(run)
        return run if owner is not None else None

    def pop(self, n: int) -> None:
        """Take `n` blocks from the head (evicting whatever they cached)."""
        self.free -= n
        runs = self._runs
        while n > 0:
            run = runs[0]
            if run.n > n:
                run.n -= n
                return
            n -= run.n
            run.n = 0
            runs.popleft()

    def take(self, run: Run, n: int) -> None:
        """A cache hit: `n` blocks of `run` leave the queue from where they are."""
        run.n -= n
        self.free -= n
        run.owner = None
