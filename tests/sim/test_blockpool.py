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
