"""After a fault: everything back to zero, read from outside the code under test.

The gateway's side comes from its own `/api/state` over HTTP (in flight, queue, KV ledger,
live requests and streams, per backend); the backends' side from each backend's own count:
the fake vLLM's `running` counter, or the `vllm:num_requests_running` gauge a real (or
simulated) vLLM exports on `/metrics`, parsed here rather than by the gateway's scraper.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterable

    from tests.gateway.fake_vllm import FakeVllm

__all__ = ["assert_back_to_zero", "fakes_running", "gateway_leftovers", "vllm_running"]

_RUNNING = re.compile(r"^vllm:num_requests_running(?:\{[^}]*\})?\s+(\S+)", re.MULTILINE)


def gateway_leftovers(state: dict[str, Any]) -> dict[str, Any]:
    """What `/api/state` still holds that a settled gateway must not (empty when clean)."""
    core = state["core"]
    left: dict[str, Any] = {
        "running": core["running"],
        "queued": core["queued"],
        "kv_blocks_in_use": core["kv_blocks_in_use"],
        "requests": len(core["requests"]),
        "streams": len(state["streams"]),
    }
    for backend in core["backends"]:
        left[f"{backend['name']}.running"] = backend["running"]
        left[f"{backend['name']}.kv_blocks_reserved"] = backend["kv_blocks_reserved"]
    return {k: v for k, v in left.items() if v}


def fakes_running(fakes: Iterable[FakeVllm]) -> Callable[[], Awaitable[list[int]]]:
    """The fakes' own count of requests they are serving."""
    fakes = list(fakes)

    async def count() -> list[int]:
        return [f.running for f in fakes]

    return count


def vllm_running(urls: Iterable[str]) -> Callable[[], Awaitable[list[int]]]:
    """Each backend's `vllm:num_requests_running` (summed over engines) from its `/metrics`;
    a backend that does not answer counts as 0 (a dead process serves nothing)."""
    urls = list(urls)

    async def count() -> list[int]:
        out = []
        async with httpx.AsyncClient(timeout=2.0) as client:
            for url in urls:
                try:
                    text = (await client.get(f"{url}/metrics")).text
                except httpx.TransportError:
                    out.append(0)
                    continue
                out.append(round(sum(float(v) for v in _RUNNING.findall(text))))
        return out

    return count


async def assert_back_to_zero(
    gateway_url: str,
    backends_running: Callable[[], Awaitable[list[int]]],
    timeout_s: float = 10.0,
) -> dict[str, Any]:
    """Wait until the gateway and its backends hold nothing; fail with what is left.

    Returns:
        The gateway's last `/api/state`.
    """
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=gateway_url, timeout=5.0) as client:
        while True:
            state = (await client.get("/api/state")).json()
            left = gateway_leftovers(state)
            running = await backends_running()
            if not left and not any(running):
                return state  # type: ignore[no-any-return]
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"not back to zero after {timeout_s} s: gateway holds {left}, "
                    f"backends run {running}"
                )
            await asyncio.sleep(0.02)
