"""Hypothesis strategies shared by the property tests.

Two kinds of governor config: `permissive_configs`, with the optional checks off (no TTFT SLA,
breaker, stale metrics or KV fit), and `strict_configs`, with every one of them on, sized so
that each binds within a few dozen steps (caps of 1-4 slots, 24-160 KV blocks, SLAs of a few
prompts' prefill, stale limits and cool-downs shorter than the time steps).
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

VIPS = ("v1", "v2", "v3")  # the protected tier's tenants
NORMALS = ("n1", "n2")
TENANTS = (*VIPS, *NORMALS, "b1")  # three VIP, two normal, one batch tenant


def policy_config(
    max_waiting: int, per_gpu: int, gpus: tuple[int, ...], **checks: Any
) -> dict[str, Any]:
    """A core config; `checks` overrides the defaults (no SLA, breaker, stale metrics, KV fit)."""
    config = {
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
            {"name": "v2", "tier": "vip", "weight": 2.0},
            {"name": "v3", "tier": "vip", "weight": 1.0},
            {"name": "n1", "tier": "normal", "weight": 1.0},
            {"name": "n2", "tier": "normal", "weight": 2.0},
            {"name": "b1", "tier": "batch", "weight": 1.0},
        ],
        "kv_pressure_threshold": 0.85,
        "ttft_sla_ms": None,
        "preemption_cooldown_ms": None,
        "queue_timeout_ms": 2000.0,
        "queue_follows_drain": True,
        "first_token_timeout_ms": 3000.0,
        "request_timeout_ms": 10000.0,
        "stale_after_ms": None,
        "prefill_tokens_per_s": 8000.0,
        "input_token_weight": 1.0,
        "output_token_weight": 2.0,
        "kv_weight": 1.0,
    }
    config.update(checks)
    return config


def _strict(backends: list[tuple[int, int]], **checks: Any) -> dict[str, Any]:
    """A config whose backends (GPUs, KV blocks) know their KV capacity, so KV fit applies."""
    config = policy_config(gpus=tuple(gpus for gpus, _ in backends), **checks)
    for backend, (_, blocks) in zip(config["backends"], backends, strict=True):
        backend["kv_blocks"] = blocks
    return config


_sizes = {
    "max_waiting": st.integers(0, 12),
    "per_gpu": st.integers(1, 4),
}
_deadlines = {  # whole milliseconds, so the µs deadlines are exact
    "queue_timeout_ms": st.none() | st.integers(300, 4000).map(float),
    "queue_follows_drain": st.booleans(),
    "first_token_timeout_ms": st.none() | st.integers(300, 4000).map(float),
    "request_timeout_ms": st.none() | st.integers(1000, 15000).map(float),
}
permissive_configs = st.builds(
    policy_config,
    gpus=st.lists(st.integers(1, 2), min_size=1, max_size=2).map(tuple),
    **_sizes,
    **_deadlines,
)
strict_configs = st.builds(
    _strict,
    backends=st.lists(st.tuples(st.integers(1, 2), st.integers(24, 160)), min_size=1, max_size=2),
    kv_pressure_threshold=st.sampled_from([0.6, 0.85, 0.95]),
    ttft_sla_ms=st.integers(100, 2000).map(float),
    prefill_tokens_per_s=st.sampled_from([500.0, 2000.0, 8000.0]),
    preemption_cooldown_ms=st.integers(200, 4000).map(float),
    stale_after_ms=st.integers(300, 3000).map(float),
    input_token_weight=st.sampled_from([0.5, 1.0]),
    output_token_weight=st.sampled_from([1.0, 2.0]),
    kv_weight=st.sampled_from([0.0, 1.0, 3.0]),
    **_sizes,
    **_deadlines,
)
tenants = st.sampled_from(TENANTS)
prompt_tokens = st.integers(0, 200) | st.integers(200, 1500)  # up to 94 blocks of 16
max_tokens = st.integers(1, 600)
time_steps_us = st.integers(0, 1_500_000)
