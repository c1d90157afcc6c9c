"""The rules both reference models state, written once: where a request may start and when it
times out.

`model.py` (the runtime's reference, run by `llmflow config verify` and `property_tests/`) and
`property_tests/models.py` (the governor's, which also predicts every `submit` decision and the
fair order) each track their own state from what their state machine fed and saw; these pure
functions turn that state and the core's config into the answer the core must agree with. They
are written from the documented rules, never from the core's code or state.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, overload

if TYPE_CHECKING:
    from collections.abc import Mapping

MAX_SHED_LEVEL = 3  # the preemption breaker's highest level; each halves unprotected tiers' cap


@overload
def us(ms: float) -> int: ...
@overload
def us(ms: float | None) -> int | None: ...
def us(ms: float | None) -> int | None:
    """A config duration in microseconds (None: off)."""
    return None if ms is None else round(ms * 1000)


def blocks(tokens: int, block_size: int) -> int:
    """KV blocks `tokens` occupy."""
    return -(-tokens // block_size)


def stale(now: int, seen_at: int | None, stale_after_ms: float | None) -> bool:
    """A backend's metrics are stale once its last scrape is older than `stale_after_ms`."""
    limit = us(stale_after_ms)
    return limit is not None and seen_at is not None and now - seen_at > limit


def kv_usage(reported: float | None, ledger: int, capacity: int, is_stale: bool) -> float:
    """KV usage: the last scrape while fresh; once stale, never below the ledger's estimate (the
    blocks the running requests hold over the backend's capacity); the estimate alone before
    any scrape."""
    estimate = min(ledger / capacity, 1.0) if capacity else 0.0
    if reported is None:
        return estimate
    return max(reported, estimate) if is_stale else reported


def kv_fits(prompt_blocks: int, capacity: int, busy: bool, usage: float, ledger: int) -> bool:
    """Free KV blocks hold the prompt plus one block (a backend of unknown size, or idle: yes)."""
    if not capacity or not busy:
        return True
    used = max(math.ceil(usage * capacity), ledger)
    return prompt_blocks < max(capacity - used, 0)


def slot_limits(cap: int, tier: Mapping[str, Any], is_stale: bool, level: int) -> tuple[int, int]:
    """(slots a tier may see on a backend in all, slots of its own there): the cap, halved while
    the metrics are stale and, for an unprotected tier, once per breaker level (at least one);
    the tier's `max_share` of the cap (at least one, at most that total)."""
    total = max(cap // 2, 1) if is_stale else cap
    if not tier["protected"]:
        total = max(total >> level, 1)
    return total, min(max(math.floor(cap * tier["max_share"]), 1), total)


def cooled(level: int, until: int, now: int, cooldown_ms: float | None) -> tuple[int, int]:
    """The breaker's (level, when it next drops) at `now`: one level off per elapsed cool-down."""
    cooldown = us(cooldown_ms)
    while cooldown and level > 0 and now >= until:
        level -= 1
        until += cooldown
    return level, until


def deadlines(
    policy: Mapping[str, Any],
    arrived: int,
    queued: bool,
    started: int | None,
    first_token: bool,
    prompt: int,
) -> list[tuple[int, int]]:
    """A request's pending deadlines, (at µs, 0 queue / 1 first token / 2 total): the queue's
    wait limit while it is `queued`, the first-token timeout from its start (on top of its
    prompt's own prefill at the configured rate) until its first token, the total deadline."""
    keys = ("queue", "first_token", "request")
    queue, first, total = (us(policy[f"{k}_timeout_ms"]) for k in keys)
    out: list[tuple[int, int]] = []
    if queue is not None and queued:
        out.append((arrived + queue, 0))
    if first is not None and started is not None and not first_token:
        own = int(prompt * 1e6 / policy["prefill_tokens_per_s"])
        out.append((started + first + own, 1))
    if total is not None:
        out.append((arrived + total, 2))
    return out
