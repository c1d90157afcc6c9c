"""The peak chunk rate: the most streams a gateway relays while adding <= 5 ms to the gaps.

Staggered starts only (the steady shape the limit is about); each probe runs direct and then
the gateway at the same streams, as the levels phase does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from benchmarks.gatewaybench.phases import (
    Profile,
    Target,
    line,
    measure,
    minus,
    nominal,
    offered,
    rounded,
)

if TYPE_CHECKING:
    from collections.abc import Callable

ADDED_GAP_LIMIT_MS = 5.0  # the gateway adds at most this to the clients' gap p99
HARNESS_DELIVERY = 0.95  # direct delivering less of its schedule: CPU 0 is the limit


def _gateway_ok(added_gap_p99: float | None, refused: int) -> bool:
    return added_gap_p99 is not None and added_gap_p99 <= ADDED_GAP_LIMIT_MS and refused == 0


def _harness_ok(direct: dict[str, Any]) -> bool:
    """Whether CPU 0 kept up: direct delivered what the backend's schedule offers."""
    return bool(direct["chunks_per_s"] >= HARNESS_DELIVERY * nominal(direct["streams"]))


async def search(
    gateway: Target,
    direct: Target,
    level_rows: list[dict[str, Any]],
    prof: Profile,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """The most streams (x 100 chunks/s offered) at which the gateway adds <= 5 ms to the
    clients' inter-chunk gap p99.

    The levels phase's medians (staggered starts) give the first bracket (every level up to
    `lo` passes, `hi` fails); past the top level the streams double, then `peak_bisect` steps
    bisect. Each probe runs direct and then the gateway at the same streams and is tried twice
    before it counts as a failure (a neighbour's burst should not end the search). Where the
    gateway passes but direct itself delivers under 95% of the schedule, the harness on CPU 0
    is the limit, not the gateway: the search stops there and says so (`bound: harness`).
    """
    staggered = [r for r in level_rows if r.get("mode", "staggered") == "staggered"]
    rows = {r["streams"]: r for r in staggered if r["arm"] == gateway.arm}
    direct_rows = {r["streams"]: r for r in staggered if r["arm"] == "direct"}
    probes: list[dict[str, Any]] = []
    lo, hi, bound = 0, None, "cap"
    for level in sorted(rows):
        if not _gateway_ok(rows[level]["added_gap_p99_ms"], rows[level]["refused"]):
            hi, bound = level, "gateway"
            break
        if not _harness_ok(direct_rows[level]):
            bound = "harness"
            break
        lo = level
    streams = max(1, lo * 2)
    while bound == "cap" and streams <= prof.peak_max:
        verdict = await _probe(gateway, direct, streams, prof, probes, log)
        if verdict != "pass":
            hi, bound = (streams, "gateway") if verdict == "fail" else (None, "harness")
            break
        lo, streams = streams, streams * 2
    for _ in range(prof.peak_bisect):
        if hi is None or hi - lo <= max(1, lo // 16):
            break
        mid = (lo + hi) // 2
        verdict = await _probe(gateway, direct, mid, prof, probes, log)
        if verdict == "harness":
            bound = "harness"
            break
        lo, hi = (mid, hi) if verdict == "pass" else (lo, mid)
    return {
        "arm": gateway.arm,
        "streams": lo,
        "offered_chunks_per_s": offered(lo),
        "first_failure_streams": hi,
        "bound": bound,
        "at_peak": _at(lo, rows, probes),
        "probes": probes,
    }


async def _probe(
    gateway: Target,
    direct: Target,
    streams: int,
    prof: Profile,
    probes: list[dict[str, Any]],
    log: Callable[[str], None],
) -> str:
    """'pass', 'fail' (twice), or 'harness' (the gateway passed, direct missed its bound)."""
    verdict = "fail"
    for _ in range(2):
        d = await measure(direct, streams, prof.peak_window_s, prof.warmup_s)
        g = await measure(gateway, streams, prof.peak_window_s, prof.warmup_s)
        added = minus(g["gap_p99_ms"], d["gap_p99_ms"])
        if not _gateway_ok(added, g["refused"]):
            verdict = "fail"
        elif not _harness_ok(d):
            verdict = "harness"  # the gateway kept up with a harness that did not
        else:
            verdict = "pass"
        probes.append(
            {
                "streams": streams,
                "direct": d,
                "gateway": g,
                "verdict": verdict,
                "added_gap_p99_ms": rounded(added),
            }
        )
        log(line(d))
        log(line(g) + f"  added gap p99 {rounded(added)} ms: {verdict}")
        if verdict != "fail":
            break
    return verdict


_AT_PEAK = ("chunks_per_s", "cpu_util", "gap_p99_ms", "harness_cpu_util", "cpu_us_per_chunk")


def _at(
    streams: int, rows: dict[int, dict[str, Any]], probes: list[dict[str, Any]]
) -> dict[str, Any]:
    """The gateway's figures at its peak: the passing probe, else the levels phase's median."""
    for p in reversed(probes):
        if p["streams"] == streams and p["verdict"] == "pass":
            g = p["gateway"]
            return {k: g.get(k) for k in _AT_PEAK}
    row = rows.get(streams, {})
    return {k: row.get(k) for k in _AT_PEAK}
