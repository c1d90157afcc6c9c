"""Strategies for the runtime state machine: a config with every check on, prompts, time steps.

The world is small on purpose (caps of 1-12 slots, 20-300 KV blocks, a queue of 0-10) so that
caps, queues, KV, deadlines and the breaker all bind within a few dozen steps.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from llmflow.verify.machine import PROMPTS, STEPS

TIERS = (  # name, shed_at, max_share, protected
    ("vip", 1.0, 1.0, True),
    ("gold", 0.9, 1.0, False),
    ("silver", 0.7, 0.75, False),
    ("batch", 0.5, 0.5, False),
)
TENANTS = (  # name, tier, weight
    ("v1", "vip", 1.0), ("v2", "vip", 2.0), ("v3", "vip", 1.0),
    ("g1", "gold", 1.0), ("g2", "gold", 3.0),
    ("s1", "silver", 1.0), ("s2", "silver", 1.0),
    ("b1", "batch", 1.0), ("b2", "batch", 2.0),
)  # fmt: skip
PROTECTED = {name for name, tier, _ in TENANTS if tier == "vip"}
__all__ = ["PROMPTS", "PROTECTED", "STEPS", "TENANTS", "TIERS", "runtime_configs"]


@st.composite
def runtime_configs(draw: st.DrawFn) -> dict[str, Any]:
    """A runtime with every check on, small enough that caps, queues and KV fill up."""
    gpus = draw(st.lists(st.sampled_from([1, 2, 4]), min_size=2, max_size=3, unique=True))
    ms = lambda *options: draw(st.sampled_from(options))  # noqa: E731
    policy = {
        "backends": [
            {"name": f"b{i}", "gpus": g, "kv_blocks": draw(st.integers(20, 300))}
            for i, g in enumerate(gpus)
        ],
        "block_size": 16,
        "max_concurrency_per_gpu": draw(st.integers(1, 3)),
        "max_waiting": draw(st.integers(0, 10)),
        "strategy": draw(st.sampled_from(["fair", "fifo"])),
        "tiers": [
            {"name": n, "shed_at": s, "max_share": m, "protected": p} for n, s, m, p in TIERS
        ],
        "tenants": [{"name": n, "tier": t, "weight": w} for n, t, w in TENANTS],
        "kv_pressure_threshold": 0.8,
        "ttft_sla_ms": ms(300.0, 800.0, 2000.0),
        "prefill_tokens_per_s": ms(2000.0, 8000.0),
        "preemption_cooldown_ms": ms(700.0, 2500.0),
        "queue_timeout_ms": ms(800.0, 3000.0, 12_000.0),
        "queue_follows_drain": draw(st.booleans()),
        "first_token_timeout_ms": ms(1000.0, 3000.0),
        "request_timeout_ms": ms(3000.0, 9000.0),
        "stale_after_ms": ms(1500.0, 4000.0),
    }
    lifecycle = {
        "stall_timeout_ms": ms(500.0, 2000.0),
        "first_token_error": draw(st.booleans()),
        "drain_timeout_ms": ms(0.0, 1500.0, 4000.0),
        "scrape_failures_before_down": draw(st.integers(1, 3)),
    }
    return {"policy": policy, "lifecycle": lifecycle}
