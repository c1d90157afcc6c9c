"""Hypothesis strategies shared by the property tests."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

TENANTS = ("v1", "n1", "n2", "b1")  # one VIP, two normal, one batch tenant


def policy_config(max_waiting: int, per_gpu: int, gpus: tuple[int, ...]) -> dict[str, Any]:
    """A core config over the reference model's features (no SLA, breaker or stale metrics)."""
    return {
        "backends": [{"name": f"b{i}", "gpus": g, "kv_blocks": 0} for i, g in enumerate(gpus)],
        "block_size": 16,
        "max_concurrency_per_gpu": per_gpu,
        "max_waiting": max_waiting,
        "strategy": "fair",
        "tiers": [
            {"name": "vip", "shed_at": 1.0, "max_share": 1.0, "protected": True},
            {"name": "normal", "shed_at": 0.8, "max_share": 1.0, "protected": False},
            {"name": "batch", "shed_at": 0.5, "max_share": 0.5, "protected": False},
        ],
        "tenants": [
            {"name": "v1", "tier": "vip", "weight": 1.0},
            {"name": "n1", "tier": "normal", "weight": 1.0},
            {"name": "n2", "tier": "normal", "weight": 2.0},
            {"name": "b1", "tier": "batch", "weight": 1.0},
        ],
        "kv_pressure_threshold": 0.85,
        "ttft_sla_ms": None,
        "preemption_cooldown_ms": None,
        "queue_timeout_ms": 2000.0,
        "first_token_timeout_ms": 3000.0,
        "request_timeout_ms": 10000.0,
        "stale_after_ms": None,
    }


configs = st.builds(
    policy_config,
    max_waiting=st.integers(0, 12),
    per_gpu=st.integers(1, 4),
    gpus=st.lists(st.integers(1, 2), min_size=1, max_size=2).map(tuple),
)
tenants = st.sampled_from(TENANTS)
prompt_tokens = st.integers(0, 600)
max_tokens = st.integers(1, 600)
time_steps_us = st.integers(0, 1_500_000)
