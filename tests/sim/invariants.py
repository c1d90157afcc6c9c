"""Engine invariants recounted from scratch, for tests that drive `EngineCore` step by step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmflow.sim.sequence import DECODE

if TYPE_CHECKING:
    from llmflow.sim.engine import EngineCore


def check_engine(core: EngineCore) -> None:
    """Recount the engine's aggregates from its sequences (slow).

    Raises:
        AssertionError: a counter disagrees with the sequences it summarises, or the KV blocks
            in use exceed the capacity.
    """
    bs, s = core.block_size, core.step
    running = list(core.running.values())
    held = sum(-(-(q.k + s) // bs) if q.state == DECODE else q.blocks for q in running)
    assert held == core.used, (held, core.used)
    assert 0 <= core.used <= core.num_blocks, (core.used, core.num_blocks)
    runs = core.free_q._runs
    assert sum(r.n for r in runs) == core.free_q.free == core.num_blocks - core.used
    for q in core.waiting.live():  # a resumable prefix is at most the request's full blocks
        assert q.cached is None or 0 <= q.cached.n <= q.num_tokens // bs
    decoders = [q for q in running if q.state == DECODE]
    assert len(decoders) == core.n_dec
    assert sum(q.k for q in decoders) == core._sumk
    assert len(running) <= core.config.max_num_seqs
    assert len({id(q) for q in core.waiting.live()}) == core.n_waiting
