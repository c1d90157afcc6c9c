"""What the suite does to a gateway, phase by phase, and the evidence each leaves.

Each phase drives the gateway from outside (floods, disconnects, a stalled client, a batch
flood with VIP requests in it, fresh requests at the end) and records what the clients got and
what the backend saw; `invariants.py` judges the evidence. Between phases the suite waits for
the backend to be idle again, and records how long that took (the leak check).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmflow.conformance.backend import Plan, Record

if TYPE_CHECKING:
    from llmflow.conformance.backend import BackendView
    from llmflow.conformance.client import Gateway, Outcome

__all__ = ["Evidence", "Limits", "disconnects", "flood", "fresh", "settle", "stall", "vip_flood"]

# fmt: off
FLOOD_PLAN = (10, 0.1)          # tokens, seconds between tokens: each served flood request ~1 s
BATCH_PLAN = (20, 0.1)          # a batch request holds its slot ~2 s
SHORT_PLAN = (4, 0.01)          # a VIP or fresh request: served in ~40 ms once started
DISCONNECT_PLAN = (2000, 0.02)  # a 40 s stream the client leaves after 3 tokens
DISCONNECT_AFTER = 3            # tokens the leaving client reads first
DISCONNECTS = 3                 # clients that leave, one after the other
STALL_PAD = 16384               # bytes per token of the stalled stream
GATEWAY_SLACK = 16 << 20        # bytes a gateway may hold for a stalled client, beyond sockets
VIPS = 3                        # VIP requests sent into the batch flood
VIP_DELAY_S = 0.5               # the batch flood's head start
VIP_GAP_S = 0.3                 # between VIP requests
FRESH_WITHIN_S = 30.0           # a fresh request's time to be served, Retry-After honoured
# fmt: on
_MIB = 1 << 20


def socket_buffers() -> int:
    """The most the kernel holds on a stalled stream's way, in bytes: the backend's and the
    gateway's send buffers and the gateway's receive buffer, at Linux's autotuning maxima
    (`tcp_wmem`, `tcp_rmem`; 4 and 6 MiB where they cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_rmem") as r, open("/proc/sys/net/ipv4/tcp_wmem") as w:
            rmem, wmem = int(r.read().split()[2]), int(w.read().split()[2])
    except (OSError, ValueError, IndexError):
        rmem, wmem = 6 * _MIB, 4 * _MIB
    return rmem + 2 * wmem


BUFFER_BOUND = socket_buffers() + GATEWAY_SLACK  # what a stalled client may cost, in bytes
STALL_LIMIT = 2 * BUFFER_BOUND  # what the backend pushes at most before it holds


@dataclass(frozen=True)
class Limits:
    """The bounds the suite holds a gateway to."""

    abort_within_s: float  # a client's disconnect reaches the backend within this
    stall_within_s: float  # a stalled client's backend request ends within this
    flood_size: int  # requests in each flood
    fresh_requests: int  # requests sent at once at the end (the claimed cap, or 1)
    settle_s: float  # how long the backend may take to be idle after a phase


@dataclass
class Evidence:
    """What the phases saw."""

    read: list[Outcome] = field(default_factory=list)  # every request read to its end
    flood: list[Outcome] = field(default_factory=list)
    batch: list[Outcome] = field(default_factory=list)
    vip: list[Outcome] = field(default_factory=list)
    vip_running: list[int] = field(default_factory=list)  # backend running as each VIP left
    left: list[tuple[Outcome, float | None, Record | None]] = field(default_factory=list)
    stalled: Record | None = None
    settles: dict[str, float | None] = field(default_factory=dict)  # phase: seconds to idle
    peaks: dict[str, int] = field(default_factory=dict)  # phase: the backend's peak running
    fresh: list[Outcome] = field(default_factory=list)  # the last answer of each fresh request
    fresh_s: list[float | None] = field(default_factory=list)  # seconds to be served


def _plan(tag: str, shape: tuple[int, float]) -> Plan:
    return Plan(tag, tokens=shape[0], itl_s=shape[1])


async def settle(backend: BackendView, limits: Limits, ev: Evidence, phase: str) -> None:
    """Wait until the backend runs nothing; record how long it took (None: never) and the
    phase's peak."""
    ev.peaks[phase] = await backend.next_phase()
    start = time.monotonic()
    while backend.running:
        if time.monotonic() - start > limits.settle_s:
            ev.settles[phase] = None
            return
        await asyncio.sleep(0.01)
    ev.settles[phase] = time.monotonic() - start


async def flood(gw: Gateway, limits: Limits, ev: Evidence) -> None:
    """A burst of `flood_size` requests at once, every fourth one unstreamed."""
    plans = [_plan(f"flood-{i}", FLOOD_PLAN) for i in range(limits.flood_size)]
    outs = await asyncio.gather(*(gw.request(p, stream=i % 4 != 3) for i, p in enumerate(plans)))
    ev.flood += outs
    ev.read += outs


async def disconnects(gw: Gateway, backend: BackendView, limits: Limits, ev: Evidence) -> None:
    """Clients that leave mid-stream, one at a time; wait for the backend to see each go."""
    for i in range(DISCONNECTS):
        tag = f"leave-{i}"
        out, closed_at = await gw.disconnect(_plan(tag, DISCONNECT_PLAN), DISCONNECT_AFTER)
        record = await _ended(backend, tag, 2 * limits.abort_within_s + 0.5)
        ev.left.append((out, closed_at, record))


async def _ended(backend: BackendView, tag: str, timeout_s: float) -> Record | None:
    """The backend's record of `tag` once it ended, or as it is after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        runs = backend.runs(tag)
        if runs and runs[-1].ended_at is not None:
            return runs[-1]
        await asyncio.sleep(0.005)
    runs = backend.runs(tag)
    return runs[-1] if runs else None


async def stall(gw: Gateway, backend: BackendView, limits: Limits, ev: Evidence) -> None:
    """A client that sends a streamed request and never reads; wait up to `stall_within_s`
    after the backend started it for the backend to see it end."""
    plan = Plan("stall", tokens=STALL_LIMIT // STALL_PAD * 4, pad=STALL_PAD, limit=STALL_LIMIT)
    client = await gw.stall(plan)
    try:
        deadline = time.monotonic() + 10.0
        while not backend.runs("stall") and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        runs = backend.runs("stall")
        if runs:
            end = runs[0].received_at + limits.stall_within_s + 0.5
            while backend.runs("stall")[0].ended_at is None and time.monotonic() < end:
                await asyncio.sleep(0.01)
            ev.stalled = backend.runs("stall")[0]
    finally:
        client.close()


async def vip_flood(
    gw: Gateway, backend: BackendView, limits: Limits, ev: Evidence, keys: tuple[str, str]
) -> None:
    """A flood of batch requests, and VIP requests sent into it once it has begun."""
    vip_key, batch_key = keys
    batch = [
        asyncio.ensure_future(gw.request(_plan(f"batch-{i}", BATCH_PLAN), key=batch_key))
        for i in range(limits.flood_size)
    ]
    await asyncio.sleep(VIP_DELAY_S)
    vips = []
    for j in range(VIPS):
        ev.vip_running.append(backend.running)
        vips.append(asyncio.ensure_future(gw.request(_plan(f"vip-{j}", SHORT_PLAN), key=vip_key)))
        await asyncio.sleep(VIP_GAP_S)
    ev.vip += await asyncio.gather(*vips)
    ev.batch += await asyncio.gather(*batch)
    ev.read += ev.vip + ev.batch


async def fresh(gw: Gateway, limits: Limits, ev: Evidence) -> None:
    """`fresh_requests` requests at once at the end, each retried after its Retry-After."""
    results = await asyncio.gather(*(_served(gw, ev, i) for i in range(limits.fresh_requests)))
    for out, seconds in results:
        ev.fresh.append(out)
        ev.fresh_s.append(seconds)


async def _served(gw: Gateway, ev: Evidence, i: int) -> tuple[Outcome, float | None]:
    start = time.monotonic()
    attempt = 0
    while True:
        out = await gw.request(_plan(f"fresh-{i}-{attempt}", SHORT_PLAN))
        ev.read.append(out)
        if out.verdict() == "complete":
            return out, time.monotonic() - start
        left = start + FRESH_WITHIN_S - time.monotonic()
        if out.status not in (429, 503) or left <= 0:
            return out, None
        await asyncio.sleep(min(left, _wait_s(out.retry_after())))
        attempt += 1


def _wait_s(retry_after: str | None) -> float:
    try:
        return min(max(float(retry_after or 1), 0.1), 10.0)
    except ValueError:
        return 1.0

