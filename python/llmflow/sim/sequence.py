"""Requests inside a simulated vLLM engine: `Seq`, its states, and the engine's launch flags.

`Seq` is what `EngineCore` schedules; `SeqOwner` is told of its first token and its end.
`EngineConfig` holds the vLLM flags the model needs, named as on vLLM's command line.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from llmflow.sim.blockpool import Run

__all__ = ["DECODE", "DONE", "LOADING", "PREFILL", "SWAPPED", "WAITING", "EngineConfig",
           "EngineError", "Seq", "SeqOwner", "StepRecord", "WaitingQueue"]

WAITING, PREFILL, DECODE, SWAPPED, DONE = range(5)
LOADING = 5  # P/D decode side: blocks allocated, the prompt's KV on its way (`sim/disagg.py`)
STATE_NAMES = ("waiting", "prefill", "decode", "swapped", "done", "loading")


class EngineError(ValueError):
    """A request the engine refuses, as vLLM answers 400 (too long for `max_model_len`)."""


class SeqOwner(Protocol):
    """Who hears about a sequence's first token and end (a client attempt, a test log)."""

    def on_first_token(self, seq: Seq, now: float) -> None:
        """The first output token was sampled at `now`."""

    def on_finished(self, seq: Seq, now: float) -> None:
        """The sequence ended at `now`; `seq.finish_reason` says why."""

    def on_tokens_reached(self, seq: Seq, now: float) -> None:
        """The sequence has generated `seq.notify_at` tokens (called only when it is set)."""


@dataclass(frozen=True)
class EngineConfig:
    """vLLM launch flags the model needs (names as vLLM's CLI)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    max_model_len: int = 8192
    num_gpu_blocks: int | None = None  # None: derived from GPU memory by the cost model
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    swap_space_blocks: int = 0  # host blocks for swap preemption (vLLM --swap-space)
    long_prefill_token_threshold: int = 0  # 0: a prefill chunk may take the whole budget
    enable_prefix_caching: bool = True  # a preempted request finds its surviving blocks cached
    scheduler_reserve_full_isl: bool = True  # admit only when the whole sequence's blocks fit
    watermark: float = 0.0  # fraction of KV blocks kept free when admitting (vLLM's watermark)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step as `EngineCore.step_log` keeps it (the counts vLLM's scheduler stats
    give after the step: `num_requests_running`, `num_requests_waiting`)."""

    step: int  # engine steps before this one
    start: float  # seconds
    end: float  # seconds
    decodes: int  # requests that computed one token
    prefill_tokens: int  # prompt (and recomputed) tokens computed
    preempted: tuple[int, ...]  # rids preempted while planning the step, in order
    running: int  # after the step: finished requests gone
    waiting: int  # after the step, preempted ones included
    used: int  # KV blocks held after the step


class Seq:
    """One request inside the engine.

    Args:
        rid: request id (unique among live sequences of this engine).
        prompt: prompt tokens.
        max_tokens: the request's cap on output tokens.
        eos_at: output tokens after which the model emits EOS (`None`: never, as `ignore_eos`).
        priority: vLLM priority (lower runs first; used by priority scheduling only).
        owner: notified of the first token and the end.
        stop_after: the client disconnects after this many tokens (`None`: never).
        notify_at: tell the owner when this many tokens are out (`None`: never).
        hash_ids: its prompt's block hashes, one per `hash_block` tokens (prefix caching
            across requests; `None`: none known, no cross-request hits).
        hash_block: tokens per hash id.
    """

    __slots__ = (
        "arrival", "blocks", "cached", "computed", "epoch", "finish_reason", "gen", "hash_block",
        "hash_ids", "hold_kv", "k", "max_tokens", "notify_at", "num_tokens", "order", "owner",
        "preemptions", "priority", "prompt", "remote_kv", "rid", "state", "stop", "stop_reason",
        "t_end", "t_first",
        "t_sched",
    )

    def __init__(
        self, rid: int, prompt: int, max_tokens: int, eos_at: int | None = None,
        priority: int = 0, owner: SeqOwner | None = None, stop_after: int | None = None,
        notify_at: int | None = None, hash_ids: tuple[int, ...] | None = None,
        hash_block: int = 16,
    ):
        self.rid, self.prompt, self.max_tokens, self.priority = rid, prompt, max_tokens, priority
        self.owner, self.notify_at = owner, notify_at
        self.stop, self.stop_reason = max_tokens, "length"
        if eos_at is not None and eos_at < self.stop:
            self.stop, self.stop_reason = max(1, eos_at), "stop"
        if stop_after is not None and stop_after < self.stop:
            self.stop, self.stop_reason = max(1, stop_after), "abort"
        self.state, self.gen, self.computed, self.blocks, self.k = WAITING, 0, 0, 0, 0
        self.cached: Run | None = None  # its blocks left in the free queue when preempted
        self.num_tokens = prompt
        self.arrival = self.t_sched = self.t_first = self.t_end = -1.0
        self.order = self.epoch = self.preemptions = 0
        self.finish_reason = ""
        # P/D disaggregation (`sim/disagg.py`): a prefill keeps its blocks after it ends until
        # its KV has been read (`hold_kv`); a decode gets its prompt's KV from a prefill
        # instance instead of computing it (`remote_kv`)
        self.hold_kv = self.remote_kv = False
        self.hash_ids, self.hash_block = hash_ids, hash_block


class WaitingQueue:
    """vLLM's waiting queue: FCFS (a deque; preempted requests go back to the front) or, with
    priority scheduling, a heap on `(priority, arrival)`. Aborted entries are skipped lazily;
    `len()` counts the live ones.

    Args:
        priority: order by priority instead of arrival.
    """

    __slots__ = ("_fifo", "_heap", "_priority", "n")

    def __init__(self, priority: bool):
        self._priority = priority
        self._fifo: deque[Seq] = deque()
        self._heap: list[tuple[int, float, int, Seq]] = []
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def push(self, seq: Seq, front: bool = False) -> None:
        """Queue `seq` (at the front when it was preempted, in FCFS order)."""
        seq.state = WAITING
        self.n += 1
        if self._priority:
            heapq.heappush(self._heap, (seq.priority, seq.arrival, seq.order, seq))
        elif front:
            self._fifo.appendleft(seq)
        else:
            self._fifo.append(seq)

    def peek(self) -> Seq:
        """The next live request (the queue must not be empty)."""
        if self._priority:
            heap = self._heap
            while heap[0][3].state != WAITING:
                heapq.heappop(heap)
            return heap[0][3]
        fifo = self._fifo
        while fifo[0].state != WAITING:
            fifo.popleft()
        return fifo[0]

    def pop(self) -> None:
        """Remove the request `peek` returned."""
        self.n -= 1
        if self._priority:
            heapq.heappop(self._heap)
        else:
            self._fifo.popleft()

    def discard(self) -> None:
        """Forget one live entry whose state the caller has just ended."""
        self.n -= 1

    def live(self) -> list[Seq]:
        """The live entries, unordered (for invariant checks)."""
        entries = [*self._fifo, *(e[3] for e in self._heap)]
        return [q for q in entries if q.state == WAITING]
