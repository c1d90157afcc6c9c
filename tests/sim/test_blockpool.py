"""vLLM V1's free block queue in runs: eviction order and cache hits."""

from __future__ import annotations

from llmflow.sim.blockpool import FreeBlockQueue


def test_blocks_are_taken_from_the_head_and_freed_to_the_tail() -> None:
    q = FreeBlockQueue(10)
    q.pop(8)  # two never-used blocks left at the head
    owner = object()
    run = q.push(6, owner)  # a preempted request's six full blocks, queued last
    assert run is not None
    assert q.free == 8
    q.pop(3)  # the two old ones, then the request's last block
    assert (q.free, run.n) == (5, 5)  # its first five blocks survive


def test_a_hit_leaves_from_the_middle_and_the_rest_stays_free() -> None:
    q = FreeBlockQueue(4)
    run = q.push(6, "victim")
    assert run is not None
    q.push(2)  # blocks of a request that ended, behind it
    q.take(run, 4)  # the victim resumes with four cached blocks
    assert (q.free, run.n, run.owner) == (8, 2, None)
    q.pop(8)  # everything else, in order
    assert q.free == 0


def test_anonymous_blocks_merge() -> None:
    q = FreeBlockQueue(0)
    assert q.push(3) is None
    assert q.push(0, "nobody") is None
    q.push(2)
    q.pop(5)
    assert q.free == 0


def test_the_null_block_is_never_taken() -> None:
    q = FreeBlockQueue(5, null_block=True)  # vLLM V1: block 0 is the null block
    q.pop(4)  # every other block
    assert q.free == 1
    q.push(2)
    q.pop(2)  # the freed ones, not the null block
    assert q.free == 1


def test_partial_blocks_are_reused_before_cached_ones_are_evicted() -> None:
    q = FreeBlockQueue(3, null_block=True)
    q.pop(2)
    run = q.push(4, "victim")  # a preempted request's full blocks, cached, at the tail
    assert run is not None
    q.push_front(1)  # an ended request's partial block, reused first
    q.pop(1)
    assert run.n == 4  # the victim's cache is intact
    q.pop(1)  # then the head of the queue: the victim's last block is evicted
    assert (run.n, q.free) == (3, 4)
