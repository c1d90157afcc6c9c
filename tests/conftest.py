"""Shared fixtures for the Python tests."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from llmflow.config import load_settings
from tests.processes import RedisProcess

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path


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


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    """A real `redis-server` (Debian's) on a free port, killed after the test."""
    with RedisProcess(tmp_path / "redis") as server:
        yield server
