"""One vLLM V1 engine: continuous batching with chunked prefill over a paged KV cache.

`EngineCore` is pure bookkeeping (no SimPy, no clock): `schedule()` plans the next step and
returns its duration, `complete(now)` applies it. It follows vLLM V1's scheduler:

1. running requests first, in admission order: each decode takes one token of the step budget
   (`max_num_batched_tokens`), each unfinished prefill the next chunk of what is left;
2. when their KV blocks do not fit, preempt from the tail of the running list (FCFS) or the
   worst `(priority, arrival)` (priority scheduling) until they do; a preempted request frees
   its KV and is put back at the head of the waiting queue to be recomputed (vLLM V1), or is
   swapped to host memory over PCIe when `preemption="swap"`. With prefix caching (vLLM's
   default) its full blocks stay cached in the free queue until they are reused
   (`blockpool.FreeBlockQueue`; partial blocks are reused first, and vLLM V1's null block is
   never handed out), so its recompute starts after the prefix that survived;
3. if nothing was preempted, admit waiting requests in order while the budget, `max_num_seqs`
   and free blocks allow: the head's whole sequence must fit (`scheduler_reserve_full_isl`,
   vLLM's default) plus the watermark, or, without that flag, its first chunk; the head that
   does not fit blocks the rest. The last one admitted may get a partial chunk.

Prefix caching across requests (vLLM V1's default) applies to requests that carry block hash
ids (`Seq.hash_ids`: a trace's, or a generated workload's): a new request skips the prefill of
its leading blocks whose hashes the engine holds (never its last token), and its blocks join the
cache once its first token is out. The cache is an LRU set of hashes as large as the KV cache;
a hit refreshes it. Simplification: a hit block is counted as a block of its own for each
request (vLLM shares one block between the requests that hit it), so the KV use of requests
sharing a prefix reads high; the prefill work saved, which sets TTFT, is exact.

The hot path is O(1) per step in the number of decoding requests: decoders are kept in
aggregate. A decoder's computed-token count is `c = k + step`, so it needs a new block exactly
when `(k + step) % block_size == 0`; counting decoders by `k % block_size` gives the number of
new blocks a step needs in one lookup, and a heap keyed by finishing step gives completions.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from typing import TYPE_CHECKING

from llmflow.sim.blockpool import FreeBlockQueue
from llmflow.sim.sequence import (
    DECODE,
    DONE,
    LOADING,
    PREFILL,
    SWAPPED,
    WAITING,
    EngineConfig,
    EngineError,
    Seq,
    SeqOwner,
    StepRecord,
    WaitingQueue,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from llmflow.sim.costmodel import StepCost

__all__ = ["DONE", "EngineConfig", "EngineCore", "EngineError", "Seq", "SeqOwner", "StepRecord"]


class EngineCore:
    """Scheduler state of one vLLM instance; see the module docstring.

    Args:
        config: launch flags.
        cost: step-time model (gives the KV capacity when `config.num_gpu_blocks` is None).

    Raises:
        EngineError: `max_model_len` does not fit in the KV cache, or inconsistent flags.
    """

    def __init__(self, config: EngineConfig, cost: StepCost):
        self.config, self.cost = config, cost
        self.block_size = bs = config.block_size
        self.num_blocks = config.num_gpu_blocks or cost.kv_blocks(
            bs, config.max_num_batched_tokens, config.max_num_seqs)
        if config.max_num_batched_tokens < config.max_num_seqs:
            raise EngineError("max_num_batched_tokens must be >= max_num_seqs (as vLLM checks)")
        if self.num_blocks * bs < config.max_model_len:  # vLLM's check counts the null block
            raise EngineError(
                f"max_model_len {config.max_model_len} needs {-(-config.max_model_len // bs)} "
                f"KV blocks but only {self.num_blocks} fit; lower max_model_len"
            )
        self._priority = config.scheduling_policy == "priority"  # picks preemption victims
        self._swap = config.preemption_mode == "swap"
        self._thr = config.long_prefill_token_threshold
        self._cache = config.enable_prefix_caching and not self._swap
        self._full_isl = config.scheduler_reserve_full_isl
        self._watermark = int(config.watermark * self.num_blocks)
        # vLLM V1's block pool takes block 0 as its null block (`BlockPool.null_block`) and never
        # hands it out: requests share num_gpu_blocks - 1 (`kv_cache_usage_perc` divides by it).
        # Swap preemption is vLLM V0's, whose block manager had no null block.
        self.cap = self.num_blocks - (0 if self._swap else 1)
        self.free_q = FreeBlockQueue(self.num_blocks, null_block=not self._swap)  # eviction order
        self.cache_hit_tokens = 0  # tokens a resumed request did not recompute
        self._prefix: OrderedDict[int, None] = OrderedDict()  # cached hashes, LRU first
        self.prefix_query_tokens = 0  # prompt tokens of new requests with hash ids
        self.prefix_hit_tokens = 0  # of those, found cached (vLLM's prefix_cache_hits)
        self.requests_added = 0
        self.step_budget_used = 0.0  # the planned step's share of `max_num_batched_tokens`
        self.step = 0  # engine steps completed
        self.used = 0  # GPU blocks held
        self.cpu_used = 0  # host blocks held by swapped sequences
        self.running: dict[int, Seq] = {}  # admission order: the tail is preempted first
        self.prefilling: dict[int, Seq] = {}
        self.waiting = WaitingQueue(config.scheduling_policy == "priority")
        self.swapped: deque[Seq] = deque()
        self.n_swapped = 0
        self.n_dec = 0
        self._cnt = [0] * bs  # decoders by k % block_size
        self._sumk = 0  # sum of k over decoders: their total context is sumk + n_dec * step
        self._heap: list[tuple[int, int, int, Seq]] = []  # (finish step, order, epoch, seq)
        self._notes: list[tuple[int, int, int, Seq]] = []  # (step reaching notify_at, ...)
        self.reached: list[Seq] = []  # sequences that reached notify_at in the last step
        self._chunks: list[tuple[Seq, int, int]] = []  # (seq, tokens, new blocks) of this step
        self.in_step = False
        self._order = 0
        self.num_preemptions = 0
        # one `StepRecord` per step when a list is set here (tests, fidelity reports)
        self.step_log: list[StepRecord] | None = None
        self._preempted_now: list[int] = []  # rids preempted while planning this step
        self._started = 0.0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.peak_used = 0
        # P/D disaggregation (`sim/disagg.py`): requests whose prompt KV is on its way, the
        # hook that starts a transfer, and ended prefills whose KV waits to be read
        self.loading: dict[int, Seq] = {}
        self.on_load: Callable[[Seq], None] | None = None
        self.kv_held: dict[int, Seq] = {}

    # ---- requests in and out -------------------------------------------------------------

    def add(self, seq: Seq, now: float) -> None:
        """Queue a new request (vLLM's `add_request`).

        Raises:
            EngineError: prompt plus `max_tokens` exceed `max_model_len`, or an empty prompt.
        """
        limit = self.config.max_model_len
        if seq.prompt < 1 or seq.max_tokens < 1:
            raise EngineError("prompt and max_tokens must be at least 1 token")
        if seq.prompt + seq.max_tokens > limit:
            raise EngineError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{seq.prompt + seq.max_tokens} tokens ({seq.prompt} in the messages, "
                f"{seq.max_tokens} in the completion)."
            )
        self._order += 1
        self.requests_added += 1
        seq.order, seq.arrival, seq.state = self._order, now, WAITING
        self.waiting.push(seq)

    def abort(self, seq: Seq, now: float, reason: str = "abort") -> bool:
        """Abort a live request (client disconnect) and free its blocks at once.

        An abort during a step drops that step's work for the sequence, as vLLM discards the
        output of an aborted request. The owner is not notified: the caller is the one aborting.

        Returns:
            False when the sequence had already ended.
        """
        if seq.state == DONE:
            return False
        seq.finish_reason = reason
        self._remove(seq, now)
        return True

    def loaded(self, seq: Seq) -> None:
        """The prompt's KV of a `remote_kv` request has arrived: it joins the running batch
        with its last prompt token left to compute, which samples its first output token (as
        vLLM's connectors do: the decode instance recomputes that one token)."""
        del self.loading[seq.rid]
        seq.state, seq.computed = PREFILL, seq.prompt - 1
        seq.remote_kv = False  # preempted later, it recomputes here (the KV was read once)
        self.running[seq.rid] = seq
        self.prefilling[seq.rid] = seq

    def release(self, seq: Seq) -> None:
        """Free the blocks an ended `hold_kv` prefill kept for its transfer."""
        if self.kv_held.pop(seq.rid, None) is not None:
            self.used -= seq.blocks
            self._free(seq.blocks, seq.computed)
            seq.blocks = 0

    def generated(self, seq: Seq) -> int:
        """Output tokens the sequence has produced so far."""
        if seq.state == DECODE:
            return seq.k + self.step - seq.prompt + 1
        return seq.gen

    @property
    def step_prefill_tokens(self) -> int:
        """Prompt tokens the planned step prefills (its chunks: recomputes in, hits out)."""
        return sum(n for _, n, _ in self._chunks)

    @property
    def n_waiting(self) -> int:
        """Requests in the waiting queue (swapped ones not included)."""
        return self.waiting.n

    @property
    def num_running(self) -> int:
        """Requests in the running batch (vLLM's `num_requests_running`)."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests waiting, swapped and loading ones included (vLLM's
        `num_requests_waiting`)."""
        return self.n_waiting + self.n_swapped + len(self.loading)

    @property
    def kv_usage(self) -> float:
        """Fraction of GPU KV blocks in use (vLLM's `kv_cache_usage_perc`, 0..1)."""
        return self.used / self.cap

    @property
    def idle(self) -> bool:
        """Nothing running, waiting, swapped or loading."""
        return (not self.running and not self.n_waiting and not self.n_swapped
                and not self.loading)

    # ---- one step ------------------------------------------------------------------------

    def schedule(self, now: float) -> float | None:
        """Plan the step starting at `now` and allocate its KV blocks.

        Returns:
            The step's duration in seconds, or None when there is nothing to run.
        """
        s, bs = self.step, self.block_size
        chunks = self._chunks
        chunks.clear()
        self._preempted_now.clear()
        self._started = now
        budget = self.config.max_num_batched_tokens - self.n_dec
        need = self._cnt[-s % bs] if self.n_dec else 0
        swap_bytes = self._swap_in(need) if self.n_swapped else 0.0
        for seq in self.prefilling.values():
            if budget <= 0:
                break
            n = min(seq.num_tokens - seq.computed, budget)
            if self._thr:
                n = min(n, self._thr)
            nb = -(-(seq.computed + n) // bs) - seq.blocks
            chunks.append((seq, n, nb))
            need += nb
            budget -= n
        if need > self.cap - self.used:
            need, swapped_out = self._preempt(need)
            swap_bytes += swapped_out
            self._alloc(need)
            if not chunks and not self.n_dec and self.n_waiting:  # all evicted: start afresh
                self._admit(self.config.max_num_batched_tokens, now)
        else:
            self._alloc(need)
            if self.n_waiting and not self.n_swapped:  # swapped ones resume before new ones
                self._admit(budget, now)
        if not chunks and not self.n_dec:
            if self._preempted_now and self.step_log is not None:
                self._record(self.step, now, 0, 0)
            return None
        self.in_step = True
        p_tok = p_attn = p_ctx = 0
        for seq, n, _ in chunks:
            o = seq.computed
            p_tok += n
            p_attn += n * (2 * o + n)
            p_ctx += o + n
        d = self.n_dec
        self.step_budget_used = (d + p_tok) / self.config.max_num_batched_tokens
        return self.cost.step_time(d, self._sumk + d * s, p_tok, p_attn, p_ctx, swap_bytes)

    def complete(self, now: float) -> tuple[list[Seq], list[Seq]]:
        """Apply the planned step at `now` (its end).

        Returns:
            (sequences whose first token came out, sequences that ended), in engine order.
        """
        s = self.step
        first: list[Seq] = []
        ended: list[Seq] = []
        planned = (self.n_dec, self.step_prefill_tokens) if self.step_log is not None else None
        self.generation_tokens_total += self.n_dec
        reached = self.reached
        reached.clear()
        for seq, n, nb in self._chunks:
            seq.computed += n
            seq.blocks += nb
            if seq.computed < seq.num_tokens:
                continue
            del self.prefilling[seq.rid]
            seq.gen += 1
            self.generation_tokens_total += 1
            if seq.t_first < 0:
                seq.t_first = now
                self.prompt_tokens_total += seq.prompt
                first.append(seq)
                if seq.hash_ids and self._cache:
                    self._remember(seq)
            if seq.gen == seq.notify_at:
                reached.append(seq)
            if seq.gen >= seq.stop:
                seq.finish_reason = seq.stop_reason
                self._free_running(seq, now, seq.blocks, seq.computed)
                ended.append(seq)
            else:
                self._to_decode(seq, seq.computed, s + 1)
        self._chunks.clear()
        self.step = s = s + 1
        notes = self._notes
        while notes and notes[0][0] < s:
            _, _, epoch, seq = heapq.heappop(notes)
            if seq.state == DECODE and seq.epoch == epoch:
                reached.append(seq)
        heap = self._heap
        while heap and heap[0][0] < s:
            _, _, epoch, seq = heapq.heappop(heap)
            if seq.state != DECODE or seq.epoch != epoch:
                continue
            self._leave_decode(seq)
            seq.gen = seq.stop
            seq.finish_reason = seq.stop_reason
            self._free_running(seq, now, -(-(seq.k + s) // self.block_size), seq.k + s)
            ended.append(seq)
        self.in_step = False
        if planned is not None:
            self._record(s - 1, now, *planned)
        return first, ended

    # ---- internals -----------------------------------------------------------------------

    def _record(self, step: int, now: float, decodes: int, prefill_tokens: int) -> None:
        assert self.step_log is not None
        self.step_log.append(StepRecord(
            step, self._started, now, decodes, prefill_tokens, tuple(self._preempted_now),
            len(self.running), self.num_waiting, self.used))

    def _alloc(self, n: int) -> None:
        self.used += n
        self.free_q.pop(n)
        if self.used > self.peak_used:
            self.peak_used = self.used

    def _admit(self, budget: int, now: float) -> None:
        bs, cap, thr = self.block_size, self.config.max_num_seqs, self._thr
        while self.n_waiting and budget > 0 and len(self.running) < cap:
            seq = self.waiting.peek()
            if seq.remote_kv:
                if not self._admit_remote(seq, now):
                    break
                continue
            run = seq.cached
            hits = min(run.n, (seq.num_tokens - 1) // bs) if run is not None else 0
            shared = 0  # blocks found in the prefix cache (a new request's)
            if run is None and seq.hash_ids and self._cache and seq.t_sched < 0:
                shared = hits = min(self._matched(seq) // bs, (seq.num_tokens - 1) // bs)
            computed = hits * bs
            n = min(seq.num_tokens - computed, budget)
            if thr:
                n = min(n, thr)
            nb = -(-(computed + n) // bs) - hits
            required = -(-seq.num_tokens // bs) if self._full_isl else hits + nb
            if self.running:  # vLLM keeps its watermark only when something else runs
                required += self._watermark
            if required > self.cap - self.used:
                break
            self.waiting.pop()
            if run is not None:
                self.free_q.take(run, hits)
                self.used += hits
                seq.cached = None
                self.cache_hit_tokens += computed
            elif seq.hash_ids and self._cache and seq.t_sched < 0:
                self.prefix_query_tokens += seq.prompt
                self.prefix_hit_tokens += computed
                self._alloc(shared)  # cached free blocks leave the queue for this request
            self._alloc(nb)
            seq.state, seq.computed, seq.blocks = PREFILL, computed, hits
            if seq.t_sched < 0:
                seq.t_sched = now
            self.running[seq.rid] = seq
            self.prefilling[seq.rid] = seq
            self._chunks.append((seq, n, nb))
            budget -= n

    def _matched(self, seq: Seq) -> int:
        """Leading prompt tokens whose blocks the prefix cache holds (refreshing them)."""
        cache = self._prefix
        ids = seq.hash_ids or ()
        matched = 0
        while matched < len(ids) and ids[matched] in cache:
            matched += 1
        for h in reversed(ids[:matched]):  # the head ends most recent, as in `_remember`
            cache.move_to_end(h)
        return matched * seq.hash_block

    def _remember(self, seq: Seq) -> None:
        """Cache the full blocks of a prompt whose prefill is done; evict the least recently
        used beyond the KV cache's size (the tail of a prompt goes before its head)."""
        cache = self._prefix
        full = seq.prompt // seq.hash_block
        for h in reversed((seq.hash_ids or ())[:full]):
            cache[h] = None
            cache.move_to_end(h)
        room = self.num_blocks * self.block_size // max(1, seq.hash_block)
        while len(cache) > room:
            cache.popitem(last=False)

    def _swap_in(self, need: int) -> float:
        bs, moved = self.block_size, 0
        while self.n_swapped and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            if seq.state != SWAPPED:
                self.swapped.popleft()
                continue
            held = seq.blocks
            if need + held > self.cap - self.used:
                break
            # resumes as a prefill of what is left (one token for a swapped decoder)
            self.swapped.popleft()
            self.n_swapped -= 1
            self.cpu_used -= held
            self._alloc(held)
            moved += held
            seq.state = PREFILL
            self.running[seq.rid] = seq
            self.prefilling[seq.rid] = seq
        return moved * bs * self.cost.kv_bytes_per_token

    def _preempt(self, need: int) -> tuple[int, float]:
        s, bs = self.step, self.block_size
        swapped_out = 0
        while need > self.cap - self.used and self.running:
            victim = self._victim()
            if victim.state == DECODE:
                if (victim.k + s) % bs == 0:
                    need -= 1
                held = -(-(victim.k + s) // bs)
                victim.computed = victim.k + s  # tokens whose KV it holds
                victim.gen = victim.computed - victim.prompt + 1
                self._leave_decode(victim)
            else:
                for i, (seq, _, nb) in enumerate(self._chunks):
                    if seq is victim:
                        need -= nb
                        del self._chunks[i]
                        break
                held = victim.blocks
                del self.prefilling[victim.rid]
            del self.running[victim.rid]
            self.used -= held
            self._free_preempted(victim, held)
            victim.preemptions += 1
            self._preempted_now.append(victim.rid)
            self.num_preemptions += 1
            if self._swap and self.cpu_used + held <= self.config.swap_space_blocks:
                victim.state, victim.blocks = SWAPPED, held
                victim.num_tokens = victim.prompt + victim.gen
                self.cpu_used += held
                self.swapped.append(victim)
                self.n_swapped += 1
                swapped_out += held
            else:
                victim.computed = victim.blocks = 0
                victim.num_tokens = victim.prompt + victim.gen
                self.waiting.push(victim, front=True)
        return need, swapped_out * bs * self.cost.kv_bytes_per_token

    def _free_preempted(self, victim: Seq, held: int) -> None:
        if not self._cache:
            self.free_q.push_front(held)
            return
        full = victim.computed // self.block_size  # only full blocks are hashed and cached
        self.free_q.push_front(held - full)  # the partial block is reused first
        victim.cached = self.free_q.push(full, victim)

    def _free(self, blocks: int, tokens: int) -> None:
        # vLLM's `BlockPool.free_blocks`: the full (hashed) blocks of `tokens` computed tokens
        # go to the tail of the free queue, the partial one (all, without caching) to the head
        full = min(blocks, tokens // self.block_size) if self._cache else 0
        self.free_q.push_front(blocks - full)
        self.free_q.push(full)

    def _victim(self) -> Seq:
        if self._priority:
            return max(self.running.values(), key=lambda q: (q.priority, q.arrival, q.order))
        return self.running[next(reversed(self.running))]

    def _to_decode(self, seq: Seq, computed: int, step: int) -> None:
        seq.state = DECODE
        seq.k = k = computed - step
        self._cnt[k % self.block_size] += 1
        self._sumk += k
        self.n_dec += 1
        # finishes at the end of the step in which its computed count is prompt + stop - 2
        heapq.heappush(self._heap, (seq.prompt + seq.stop - 2 - k, seq.order, seq.epoch, seq))
        if seq.notify_at is not None and seq.gen < seq.notify_at < seq.stop:
            heapq.heappush(self._notes,
                           (seq.prompt + seq.notify_at - 2 - k, seq.order, seq.epoch, seq))

    def _leave_decode(self, seq: Seq) -> None:
        self._cnt[seq.k % self.block_size] -= 1
        self._sumk -= seq.k
        self.n_dec -= 1
        seq.epoch += 1

    def _free_running(self, seq: Seq, now: float, blocks: int, tokens: int) -> None:
        del self.running[seq.rid]
        if seq.hold_kv:  # a connector's delayed free: kept until the decode side has read it
            self.kv_held[seq.rid] = seq
            seq.state, seq.t_end = DONE, now
            return
        self.used -= blocks
        self._free(blocks, tokens)
        seq.state, seq.blocks, seq.t_end = DONE, 0, now

    def _remove(self, seq: Seq, now: float) -> None:
        state = seq.state
        if state == WAITING:
            self.waiting.discard()
            seq.cached = None  # its cached blocks stay in the queue, of use to no one
        elif state == LOADING:
            del self.loading[seq.rid]
            self.used -= seq.blocks
            self.free_q.push_front(seq.blocks)  # a load's blocks are cached only once it ends
        elif state == SWAPPED:
            self.n_swapped -= 1
            self.cpu_used -= seq.blocks
        elif state == PREFILL:
            held = seq.blocks
            if self.in_step:  # its chunk of this step already holds blocks
                for i, (q, _, nb) in enumerate(self._chunks):
                    if q is seq:
                        held += nb
                        del self._chunks[i]
                        break
            del self.prefilling[seq.rid]
            del self.running[seq.rid]
            self.used -= held
            self._free(held, seq.computed)
        elif state == DECODE:
            c = seq.k + self.step  # computed tokens; this step's slot is allocated if in_step
            seq.gen = c - seq.prompt + 1
            self._leave_decode(seq)
            del self.running[seq.rid]
            held = -(-(c + self.in_step) // self.block_size)
            self.used -= held
            self._free(held, c)
        seq.state, seq.blocks, seq.t_end = DONE, 0, now

    def _admit_remote(self, seq: Seq, now: float) -> bool:
        # vLLM's WAITING_FOR_REMOTE_KVS: the whole prompt's blocks (plus the watermark) must
        # fit; they are allocated now, the transfer starts, and the request takes no step
        # budget until the KV is here. Loading requests count against max_num_seqs.
        nb = -(-seq.prompt // self.block_size)
        required = nb + (self._watermark if self.running else 0)
        if (required > self.cap - self.used
                or len(self.running) + len(self.loading) >= self.config.max_num_seqs):
            return False
        self.waiting.pop()
        self._alloc(nb)
        seq.state, seq.blocks = LOADING, nb
        if seq.t_sched < 0:
            seq.t_sched = now
        self.loading[seq.rid] = seq
        if self.on_load is not None:
            self.on_load(seq)
        return True
