"""The real gateway (`llmflow serve --config FILE`) for integration tests: its config.

The gateway runs in its own process, as in production (`tests/processes.py`): its event loop,
its HTTP client to vLLM and its scraper compete with nobody in the test's interpreter. It is
ready when `/readyz` answers 200, i.e. a scrape of vLLM succeeded.
"""

from __future__ import annotations

from typing import Any

from tests.processes import GatewayProcess

__all__ = ["GatewayProcess", "gateway_config"]


def gateway_config(backend_url: str, *, priority: bool = False, **sections: Any) -> dict[str, Any]:
    """A gateway config for one vLLM backend serving `tiny`, with section overrides.

    Defaults that keep tests exact: chunks forwarded as they come (no coalescing). Scrapes stay
    at the default 500 ms: the scrape timeout is twice the interval, and a busy CPU vLLM can
    take over 200 ms to answer `/metrics`. Each keyword is a config section merged over these
    (one level deep).
    """
    data: dict[str, Any] = {
        "streaming": {"sse_flush_interval": 0},
        "backends": [
            {
                "name": "vllm0",
                "url": backend_url,
                "models": ["tiny"],
                "max_model_len": 2048,
                "scheduling_policy": "priority" if priority else "fcfs",
            }
        ],
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return data
