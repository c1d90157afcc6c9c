"""Shared fixtures for the Python tests."""

from __future__ import annotations

from typing import Any

import pytest

from llmflow.config import load_settings


@pytest.fixture
def core_config() -> dict[str, Any]:
    """The defaults' core mapping with one backend of 2 slots and a queue of 4."""
    settings = load_settings(
        data={
            "gate": {"max_concurrency_per_gpu": 2, "queue": {"max_waiting": 4}},
            "tenants": [
                {"name": "acme", "tier": "vip", "api_keys": ["k-acme"]},
                {"name": "shop", "tier": "normal", "api_keys": ["k-shop"]},
                {"name": "etl", "tier": "batch", "api_keys": ["k-etl"]},
            ],
        }
    )
    return settings.to_core()
