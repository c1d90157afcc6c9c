"""The invariants, judged from the phases' evidence: one `Row` each.

Every figure comes from outside the gateway: what the suite's clients got on the wire and what
the suite's backend saw. An invariant that needs something the gateway was not said to have
(a cap, API keys and tiers) is "n/a" with the reason, never a pass.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmflow.conformance.phases import (
    BUFFER_BOUND,
    DISCONNECT_AFTER,
    DISCONNECTS,
    GATEWAY_SLACK,
    STALL_LIMIT,
    VIPS,
    socket_buffers,
)
from llmflow.conformance.report import Row

if TYPE_CHECKING:
    from llmflow.conformance.backend import BackendView
    from llmflow.conformance.phases import Evidence, Limits

__all__ = ["Claims", "rows"]

_MIB = 1 << 20


@dataclass(frozen=True)
class Claims:
    """What the user says the gateway does, and the bound it is held to."""

    max_concurrency: int | None  # the cap it enforces (None: none claimed)
    tiers: bool  # VIP and batch keys were given
    refusal_within_s: float  # a refused request's answer comes within this


def rows(claims: Claims, limits: Limits, ev: Evidence, backend: BackendView) -> list[Row]:
    """Every invariant's row, in the table's order."""
    return [
        ends_once(ev, backend),
        cap(claims, limits, ev, backend),
        bounded_queue(claims, limits, ev, backend),
        retry_after(ev),
        no_500(ev),
        disconnect(limits, ev),
        stall_slot(limits, ev),
        stall_memory(ev),
        vip(claims, limits, ev),
        no_leak(limits, ev, backend),
    ]


def ends_once(ev: Evidence, backend: BackendView) -> Row:
    """Each request read to its end got one complete reply or one error, and reached the
    backend at most once."""
    verdicts = Counter(o.verdict() for o in ev.read)
    broken = {v: n for v, n in verdicts.items() if v.startswith("broken")}
    twice = sorted(tag for tag, runs in backend.records.items() if len(runs) > 1)
    measured = (
        f"{len(ev.read)} requests: {verdicts['complete']} complete, {verdicts['error']} one "
        f"error, {sum(broken.values())} broken; {len(twice)} reached the backend twice"
    )
    if broken:
        measured += "; " + "; ".join(f"{n}x {v}" for v, n in sorted(broken.items()))
    if twice:
        measured += f" ({', '.join(twice[:5])})"
    return Row(
        "every request ends exactly once",
        "read every flood, batch, VIP and fresh request to its end (streams to [DONE])",
        "fail" if broken or twice else "pass",
        measured,
    )


def cap(claims: Claims, limits: Limits, ev: Evidence, backend: BackendView) -> Row:
    """The backend never ran more than the claimed cap."""
    done = (f"counted running requests at the backend through every phase "
            f"({limits.flood_size}-request floods)")
    peak = backend.peak_running
    phases = ", ".join(f"{phase} {n}" for phase, n in ev.peaks.items())
    if claims.max_concurrency is None:
        return Row("concurrency cap holds", done, "n/a",
                   f"no --max-concurrency: no cap claimed (backend peak {peak}: {phases})")
    ok = peak <= claims.max_concurrency
    return Row("concurrency cap holds", done, "pass" if ok else "fail",
               f"backend peak {peak} running ({phases}), cap claimed {claims.max_concurrency}")


def bounded_queue(claims: Claims, limits: Limits, ev: Evidence, backend: BackendView) -> Row:
    """Under the flood some requests were refused (something bounds what waits), and every
    refusal came within the bound."""
    done = f"{limits.flood_size} requests at once, each holding ~1 s once served"
    refused = [o for o in ev.flood if o.status is not None and o.status != 200]
    served = [o for o in ev.flood if o.status == 200]
    waits = [o.wait_s for o in served if o.wait_s is not None]
    longest = f"; served {len(served)}, longest wait to status {max(waits):.2f} s" if waits else ""
    if not refused:
        return Row("bounded queue: fast refusal", done, "fail",
                   f"0 of {len(ev.flood)} refused: nothing bounded what waits (backend peak "
                   f"{backend.peak_running}){longest}")
    slowest = max(o.wait_s or 0.0 for o in refused)
    ok = slowest <= claims.refusal_within_s
    statuses = Counter(o.status for o in refused)
    shown = ", ".join(f"{s}x{n}" for s, n in sorted(statuses.items()))
    return Row("bounded queue: fast refusal", done, "pass" if ok else "fail",
               f"{len(refused)} of {len(ev.flood)} refused ({shown}), slowest refusal "
               f"{slowest:.3f} s (bound {claims.refusal_within_s:g} s){longest}")


def retry_after(ev: Evidence) -> Row:
    """Every 429 said when to come back, in positive whole seconds."""
    done = "read Retry-After on every 429 of every phase"
    refusals = [o for o in ev.read if o.status == 429]
    if not refusals:
        return Row("Retry-After on every 429", done, "n/a", "no 429 was answered")
    sent = [o.retry_after() for o in refusals]
    bad = [v for v in sent if v is None or not _positive_seconds(v)]
    values = sorted({int(v) for v in sent if v is not None and _positive_seconds(v)})
    spread = f" ({values[0]}-{values[-1]} s)" if values else ""
    if bad:
        shown = ", ".join(repr(b) for b in sorted(set(map(str, bad)))[:3])
        return Row("Retry-After on every 429", done, "fail",
                   f"{len(bad)} of {len(refusals)} 429s without a positive integer "
                   f"Retry-After (got {shown}){spread}")
    return Row("Retry-After on every 429", done, "pass",
               f"{len(refusals)} 429s, each with Retry-After{spread}")


def _positive_seconds(value: str | None) -> bool:
    return value is not None and value.strip().isdigit() and int(value) > 0


def no_500(ev: Evidence) -> Row:
    """Backpressure was never answered with a 5xx other than 503, nor an in-band 500."""
    statuses = Counter(str(o.status) for o in ev.read if o.status is not None)
    bad = sum(n for s, n in statuses.items() if s.startswith("5") and s != "503")
    in_band = sum(o.error_codes.count("500") for o in ev.read)
    seen = ", ".join(f"{s}x{n}" for s, n in sorted(statuses.items()))
    return Row(
        "never a 500 for backpressure",
        "the statuses and in-band errors of every request sent while the backend was healthy",
        "fail" if bad or in_band else "pass",
        f"statuses {seen}; {in_band} in-band 500 errors",
    )


def disconnect(limits: Limits, ev: Evidence) -> Row:
    """Each client that left mid-stream was aborted at the backend within the bound."""
    done = f"{DISCONNECTS} clients closed the connection after {DISCONNECT_AFTER} streamed tokens"
    lags, problems = [], []
    for out, closed_at, record in ev.left:
        if closed_at is None:
            problems.append(f"{out.tag}: no stream to leave ({out.status}, {out.verdict()})")
        elif record is None or record.ended_at is None:
            problems.append(f"{out.tag}: still running at the backend")
        elif record.outcome != "aborted":
            problems.append(f"{out.tag}: {record.outcome} at the backend")
        else:
            lags.append(max(0.0, record.ended_at - closed_at))
    slowest = f"slowest {max(lags) * 1e3:.0f} ms after the client left" if lags else ""
    late = [lag for lag in lags if lag > limits.abort_within_s]
    ok = not problems and not late and len(lags) == DISCONNECTS
    parts = [f"{len(lags)}/{DISCONNECTS} aborted at the backend", slowest,
             f"bound {limits.abort_within_s:g} s", *problems]
    return Row("a leaving client frees its slot", done, "pass" if ok else "fail",
               "; ".join(p for p in parts if p))


def stall_slot(limits: Limits, ev: Evidence) -> Row:
    """The stalled client's backend request ended within the bound."""
    done = "a streamed request from a client that never reads (4 KiB receive buffer)"
    record = ev.stalled
    if record is None:
        return Row("a stalled client loses its slot", done, "fail",
                   "the request never reached the backend")
    if record.ended_at is None:
        return Row("a stalled client loses its slot", done, "fail",
                   f"still running at the backend {limits.stall_within_s:g} s after it started")
    held = record.ended_at - record.received_at
    ok = record.outcome == "aborted" and held <= limits.stall_within_s
    return Row("a stalled client loses its slot", done, "pass" if ok else "fail",
               f"{record.outcome} at the backend {held:.2f} s after it started (bound "
               f"{limits.stall_within_s:g} s)")


def stall_memory(ev: Evidence) -> Row:
    """The gateway did not take without bound what a stalled client could not read."""
    done = f"the backend pushed 16 KiB tokens, at most {STALL_LIMIT // _MIB} MiB, as fast as taken"
    record = ev.stalled
    if record is None:
        return Row("a stalled client costs bounded memory", done, "n/a",
                   "the stalled request never reached the backend")
    pushed = record.bytes_sent / _MIB
    ok = record.bytes_sent <= BUFFER_BOUND
    return Row("a stalled client costs bounded memory", done, "pass" if ok else "fail",
               f"{pushed:.1f} MiB taken from the backend while the client read nothing (bound "
               f"{BUFFER_BOUND // _MIB} MiB: this host's socket buffers, "
               f"{socket_buffers() // _MIB} MiB, + {GATEWAY_SLACK // _MIB} MiB)")


def vip(claims: Claims, limits: Limits, ev: Evidence) -> Row:
    """VIP requests sent into a batch flood were served, not refused."""
    done = f"{VIPS} VIP requests sent into a flood of {limits.flood_size} batch requests"
    if not claims.tiers:
        return Row("VIP served during a batch flood", done, "n/a",
                   "no --vip-key/--batch-key: the gateway's tiers were not named")
    served = [o for o in ev.vip if o.verdict() == "complete"]
    loaded = any(o.status in (429, 503) for o in ev.batch) or (
        claims.max_concurrency is not None and max(ev.vip_running, default=0)
        >= claims.max_concurrency)
    times = [(o.ended_at or o.sent_at) - o.sent_at for o in served]
    refused = Counter(str(o.status) for o in ev.batch if o.status != 200)
    batch = (f"batch: {sum(o.status == 200 for o in ev.batch)} served, "
             f"{sum(refused.values())} refused; backend running {ev.vip_running} as VIPs came")
    slowest = f" (slowest {max(times):.2f} s)" if times else ""
    others = [f"{o.tag}: {o.status} {o.verdict()}" for o in ev.vip if o.verdict() != "complete"]
    if not loaded:
        others.append("the batch flood did not fill the gateway (no batch refused, backend "
                      "below the cap): raise --flood")
    return Row("VIP served during a batch flood", done,
               "pass" if len(served) == VIPS and loaded else "fail",
               "; ".join([f"{len(served)}/{VIPS} VIP served{slowest}", batch, *others]))


def no_leak(limits: Limits, ev: Evidence, backend: BackendView) -> Row:
    """After each phase the backend was idle again, and fresh requests were served."""
    done = (f"waited for the backend to be idle after each phase, then sent "
            f"{limits.fresh_requests} fresh requests at once")
    stuck = [phase for phase, s in ev.settles.items() if s is None]
    served = [s for s in ev.fresh_s if s is not None]
    idle = max((s for s in ev.settles.values() if s is not None), default=0.0)
    parts = [f"backend idle within {idle:.2f} s of each phase" if not stuck
             else f"backend still running after {', '.join(stuck)}"]
    parts.append(f"{len(served)}/{limits.fresh_requests} fresh requests served"
                 + (f" in <= {max(served):.2f} s" if served else ""))
    parts += [f"{o.tag}: {o.status} {o.verdict()}" for o, s in zip(ev.fresh, ev.fresh_s,
                                                                   strict=True) if s is None]
    if backend.running:
        parts.append(f"{backend.running} still running at the backend at the end")
    ok = not stuck and len(served) == limits.fresh_requests and backend.running == 0
    return Row("no leak", done, "pass" if ok else "fail", "; ".join(parts))
