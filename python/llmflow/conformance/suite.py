"""The suite's run: check the gateway reaches the backend, run the phases, judge the rows."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmflow.conformance import phases
from llmflow.conformance.backend import MODEL, Plan
from llmflow.conformance.client import Gateway
from llmflow.conformance.invariants import Claims, rows
from llmflow.conformance.phases import Evidence, Limits

if TYPE_CHECKING:
    from collections.abc import Callable

    from llmflow.conformance.backend import BackendView
    from llmflow.conformance.client import Outcome
    from llmflow.conformance.report import Row

__all__ = ["Options", "SuiteError", "run"]

class SuiteError(Exception):
    """The suite could not drive the gateway (it is not pointed at the backend, refuses the
    suite's key, ...): no verdict."""


@dataclass(frozen=True)
class Options:
    """How to reach the gateway, what it claims, and the bounds it is held to.

    Args:
        url: the gateway's base URL.
        model: the model name the gateway serves from the suite's backend.
        api_key: the key of ordinary requests.
        max_concurrency: the cap the gateway claims to hold at the backend (None: none).
        vip_key: a key of the gateway's top tier.
        batch_key: a key of its lowest tier.
        flood: requests in each flood (None: 8x the cap, at least 32; 64 with no cap).
        abort_within_s: a disconnect reaches the backend within this.
        refusal_within_s: a refusal under the flood comes within this.
        stall_within_s: a stalled client's backend request ends within this.
        timeout_s: the longest any one request may take.
        settle_s: how long the backend may take to be idle after each phase.
        ready_within_s: how long the gateway may take to serve its first request from the
            backend (it may be started, or pointed at the backend, after the suite).
    """

    url: str
    model: str = MODEL
    api_key: str | None = None
    max_concurrency: int | None = None
    vip_key: str | None = None
    batch_key: str | None = None
    flood: int | None = None
    abort_within_s: float = 1.0
    refusal_within_s: float = 2.0
    stall_within_s: float = 60.0
    timeout_s: float = 120.0
    settle_s: float = 10.0
    ready_within_s: float = 30.0

    def limits(self) -> Limits:
        """The phases' sizes and bounds."""
        cap = self.max_concurrency
        flood = self.flood or (max(32, 8 * cap) if cap else 64)
        return Limits(self.abort_within_s, self.stall_within_s, flood, cap or 1, self.settle_s)

    def claims(self) -> Claims:
        """What the gateway is held to."""
        tiers = self.vip_key is not None and self.batch_key is not None
        return Claims(self.max_concurrency, tiers, self.refusal_within_s)


async def run(options: Options, backend: BackendView, say: Callable[[str], None]) -> list[Row]:
    """Drive the gateway at `options.url` (pointed at `backend`) and judge every invariant.

    Raises:
        SuiteError: the gateway did not serve the suite's first request from `backend`.
    """
    gw = Gateway(options.url, options.model, options.api_key, options.timeout_s)
    limits, ev = options.limits(), Evidence()
    try:
        await _preflight(gw, backend, options.ready_within_s, say)
        say(f"flood: {limits.flood_size} requests at once")
        await phases.flood(gw, limits, ev)
        await _settled(backend, limits, ev, "flood", say)
        say(f"disconnects: {phases.DISCONNECTS} clients leave mid-stream")
        await phases.disconnects(gw, backend, limits, ev)
        await _settled(backend, limits, ev, "disconnects", say)
        say(f"stalled client: reads nothing (up to {limits.stall_within_s:g} s)")
        await phases.stall(gw, backend, limits, ev)
        await _settled(backend, limits, ev, "stall", say)
        if options.vip_key and options.batch_key:
            say(f"VIP: {phases.VIPS} VIP requests into {limits.flood_size} batch requests")
            await phases.vip_flood(gw, backend, limits, ev, (options.vip_key, options.batch_key))
            await _settled(backend, limits, ev, "vip", say)
        say(f"leak check: {limits.fresh_requests} fresh requests")
        await phases.fresh(gw, limits, ev)
    finally:
        await gw.aclose()
    await backend.sync()
    return rows(options.claims(), limits, ev, backend)


async def _settled(
    backend: BackendView, limits: Limits, ev: Evidence, phase: str, say: Callable[[str], None]
) -> None:
    await phases.settle(backend, limits, ev, phase)
    seconds = ev.settles[phase]
    say(f"  backend idle after {phase}" + (f" in {seconds:.2f} s" if seconds is not None
                                           else f": still {backend.running} running"))


async def _preflight(
    gw: Gateway, backend: BackendView, within_s: float, say: Callable[[str], None]
) -> None:
    say(f"preflight: one request through {gw.base} (waiting up to {within_s:g} s)")
    deadline = time.monotonic() + within_s
    attempt = 0
    while True:
        tag = f"preflight-{attempt}"
        out = await gw.request(Plan(tag, tokens=4))
        await backend.sync()  # a standing backend's mirror may predate this request
        if out.verdict() == "complete" and backend.runs(tag):
            return
        if time.monotonic() > deadline or out.status in (400, 401, 403, 404):
            tried = f"{attempt + 1} tries in {within_s - (deadline - time.monotonic()):.1f} s"
            raise SuiteError(f"{_preflight_failure(out, bool(backend.runs(tag)))} ({tried})")
        attempt += 1
        await asyncio.sleep(0.5)


def _preflight_failure(out: Outcome, reached: bool) -> str:
    if out.status == 200 and not reached:
        return ("the gateway answered, but not from the suite's backend: point it at the URL "
                "printed above")
    detail = out.failure or f"{out.status}: {out.body[:300].decode(errors='replace')}"
    return f"the gateway did not serve a plain streamed request ({detail})"

