"""Gateway test fixtures: the anyio backend and a started gateway over one fake vLLM."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from .harness import start_gateway

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from .harness import Harness


@pytest.fixture
def anyio_backend() -> str:
    """Run async tests on asyncio (the gateway's loop)."""
    return "asyncio"


@pytest.fixture
async def gw() -> AsyncIterator[Harness]:
    """A gateway over one fake backend, default policy; checks idleness afterwards."""
    async with start_gateway() as harness:
        yield harness
