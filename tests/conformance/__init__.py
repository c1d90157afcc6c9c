"""The conformance suite's tests; `llmflow_config` is the gateway they and
`benchmarks/conformance_compare.py` put under it."""

from __future__ import annotations

from typing import Any


def llmflow_config(backend_port: int, keys: dict[str, str]) -> dict[str, Any]:
    """`llmflow serve`'s config in front of the suite's backend: a cap of 4 and a queue of 8 that
    holds (no places for what the queue drains), the stall cut at 1 s, one tenant per tier named
    by `keys` (tier -> API key); batch may borrow every slot (no headroom kept for the latency
    tiers) so that its flood fills the gateway before the VIP requests come."""
    return {
        "backends": [{"name": "b0", "url": f"http://127.0.0.1:{backend_port}",
                      "models": ["conformance"], "max_model_len": 1_000_000}],
        "metrics": {"scrape_interval_ms": 100},
        "gate": {"max_concurrency_per_gpu": 4, "headroom_quantile": None,
                 "queue": {"max_waiting": 8, "follow_drain": False}},
        "backpressure": {"stall_timeout_ms": 1000},
        "streaming": {"sse_flush_interval": 0},
        "tenants": [{"name": tier, "tier": tier, "api_keys": [key]} for tier, key in keys.items()],
    }
