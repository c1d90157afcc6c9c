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

Only blocks with a hash (full ones, with prefix caching on) are queued at the tail; a request's
partial last block, and every block when prefix caching is off, go to the head instead, to be
reused first (`BlockPool.free_blocks`: "LIFO reuse of non-cached blocks"), so a new block is
taken from a just-freed partial one before any cached block is evicted (`push_front`).

vLLM V1 takes one block out of the queue for good when it starts, its null block
(`BlockPool.null_block`). With `null_block=True` the queue keeps it as a first run of its own that
`pop` never takes, so that it counts among the blocks no request holds (`free`) but is never
handed out: a request can hold at most `blocks - 1`, and the eviction order is vLLM's.
"""

from __future__ import annotations

from collections import deque
from typing import Any

__all__ = ["NULL", "FreeBlockQueue", "Run"]

NULL = "null block"  # owner of the null block's run


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
        null_block: keep one of them as vLLM V1's null block, never taken.
    """

    __slots__ = ("_runs", "free")

    def __init__(self, blocks: int, null_block: bool = False):
        self._runs: deque[Run] = deque([Run(blocks)]) if blocks > 0 else deque()
        if null_block and blocks > 0:
            self._runs[0].n -= 1
            self._runs.appendleft(Run(1, NULL))
            if not self._runs[-1].n:
                self._runs.pop()
        self.free = blocks  # blocks in the queue, cached ones (and the null block) included

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

    def push_front(self, n: int) -> None:
        """Queue `n` freed blocks that hold no hash at the head (after the null block): they are
        taken first."""
        if n <= 0:
            return
        self.free += n
        runs = self._runs
        null = runs.popleft() if runs and runs[0].owner is NULL else None
        if runs and runs[0].owner is None:
            runs[0].n += n
        else:
            runs.appendleft(Run(n))
        if null is not None:
            runs.appendleft(null)

    def pop(self, n: int) -> None:
        """Take `n` blocks from the head (evicting whatever they cached), the null block
        excepted."""
        self.free -= n
        runs = self._runs
        null = runs.popleft() if runs and runs[0].owner is NULL else None
        while n > 0:
            run = runs[0]
            if run.n > n:
                run.n -= n
                break
            n -= run.n
            run.n = 0
            runs.popleft()
        if null is not None:
            runs.appendleft(null)

    def take(self, run: Run, n: int) -> None:
        """A cache hit: `n` blocks of `run` leave the queue from where they are."""
        run.n -= n
        self.free -= n
        run.owner = None
