"""Fault-suite fixtures: the anyio backend (the gateway's loop is asyncio)."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    """Run async tests on asyncio."""
    return "asyncio"
