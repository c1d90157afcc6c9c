"""Gateway test fixtures: the anyio backend, a started gateway over one fake vLLM, and each
test's goldens."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from . import goldens
from .harness import start_gateway

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

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


@pytest.fixture(autouse=True)
def golden_case(request: pytest.FixtureRequest) -> Iterator[None]:
    """The running test's goldens, for `goldens.reference` (read only if it asks)."""
    with goldens.case(request.node.path.stem, request.node.name):
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """A test that passed held a reply to every part of its golden (`goldens.all_held`)."""
    yield
    goldens.all_held()
