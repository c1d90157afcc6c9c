"""The phases: concurrency levels (staggered and burst starts), memory per idle stream, relay
workers; the peak chunk-rate search is in `peak`.

Every figure that says "added" is an arm minus the direct arm *of the same repeat, mode and
level*: the arms run interleaved (direct, llmflow, router, direct, llmflow, router ...) so that
a noisy neighbour on the shared machine hits them alike, and the median over repeats is kept.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from benchmarks.gatewaybench import clients, procs

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

TTFT_MS, ITL_MS, TOKENS = 20.0, 10.0, 101  # first token at 20 ms, then 100 more 10 ms apart
PERIOD_S = (TTFT_MS + (TOKENS - 1) * ITL_MS) / 1e3  # one request, back to back: 1.02 s
MODES = ("staggered", "burst")  # how a level's streams start: see `clients`


@dataclass(frozen=True)
class Profile:
    """How long and how wide each phase runs (`--quick` is the development one)."""

    levels: tuple[int, ...]
    repeats: int
    window_s: float  # measured seconds per arm and level
    warmup_s: float  # before the window: every stream started, one request period passed
    peak_window_s: float
    peak_max: int  # streams: the peak search goes no higher
    peak_bisect: int  # bisection steps between the last pass and the first failure
    memory_streams: tuple[int, ...]
    hold_settle_s: float  # after the last stream got its first token, before reading VmRSS
    modes: tuple[str, ...] = MODES
    burst_settle_s: float = 0.5  # burst: after the connections opened, before the burst
    burst_every_level: bool = True  # False: bursts at the top level only


FULL = Profile((1, 16, 64, 128, 256), 3, 4.0, 1.5, 4.0, 2048, 2, (1000, 5000), 2.0)
QUICK = Profile((1, 64, 256), 1, 2.0, 1.2, 2.0, 1024, 1, (1000,), 1.0, burst_every_level=False)


@dataclass
class Target:
    """Where an arm's clients connect, and whose CPU counts as the gateway's (None: direct)."""

    arm: str
    port: int
    proc: procs.Proc | None
    harness_pids: tuple[int, ...]  # backend and driver: CPU 0's load, to spot a harness limit


def offered(streams: int) -> float:
    """Chunks per second offered to `streams` streams, as the issue counts (100 per stream)."""
    return streams * 1e3 / ITL_MS


def nominal(streams: int) -> float:
    """Chunks per second `streams` closed-loop streams get when nothing is late (101 per
    1.02 s request each)."""
    return streams * TOKENS / PERIOD_S


async def measure(
    target: Target, streams: int, window: float, warmup: float, burst_settle: float | None = None
) -> dict[str, Any]:
    """Run `streams` paced streams through `target`; the window's figures.

    Staggered starts, warmed up for `warmup` seconds before the window; or, with
    `burst_settle`, a burst: the window opens as every stream's request goes out at once.
    """
    pid = target.proc.pid if target.proc else None
    marks: dict[str, float] = {}

    def cpu_now(suffix: str) -> None:
        marks["t" + suffix] = time.perf_counter()
        marks["g" + suffix] = procs.cpu_seconds(pid) if pid else 0.0
        # not the driver's tree: the gateways are its children too
        marks["h" + suffix] = sum(procs.cpu_seconds(p, tree=False) for p in target.harness_pids)
        for cpu, busy in procs.cpu_busy().items():
            marks[f"cpu{cpu}_{suffix}"] = busy

    def begin() -> None:
        cpu_now("0")

    def end() -> None:
        cpu_now("1")

    payload = clients.request_bytes(target.port, TOKENS, TTFT_MS, ITL_MS, hold=False)
    if burst_settle is None:
        tally = await clients.run_streams(
            target.port, streams, payload, PERIOD_S, warmup, window, (begin, end)
        )
        return {"mode": "staggered", **_summary(target, streams, tally, marks)}
    tally, burst = await clients.run_burst(
        target.port, streams, payload, burst_settle, window, (begin, end)
    )
    return {
        "mode": "burst",
        **_summary(target, streams, tally, marks),
        "burst_ttft_n": len(tally.burst_ttfts),
        "burst_ttft_p50_ms": rounded(clients.percentile(tally.burst_ttfts, 50)),
        "burst_ttft_p99_ms": rounded(clients.percentile(tally.burst_ttfts, 99)),
        "burst_write_ms": burst.write_ms,
        "connect_s": burst.connect_s,
    }


def _summary(
    target: Target, streams: int, t: clients.Tally, marks: dict[str, float]
) -> dict[str, Any]:
    gateway_cpu = marks["g1"] - marks["g0"]
    window = marks["t1"] - marks["t0"]  # as it happened: a starved driver oversleeps
    out: dict[str, Any] = {
        "arm": target.arm,
        "streams": streams,
        "offered_chunks_per_s": offered(streams),
        "chunks": t.chunks,
        "window_s": round(window, 3),
        "chunks_per_s": round(t.chunks / window),
        "requests": t.requests,
        "ttft_n": len(t.ttfts),
        "ttft_p50_ms": rounded(clients.percentile(t.ttfts, 50)),
        "ttft_p99_ms": rounded(clients.percentile(t.ttfts, 99)),
        "gap_p50_ms": rounded(clients.percentile(t.gaps, 50, t.zero_gaps)),
        "gap_p99_ms": rounded(clients.percentile(t.gaps, 99, t.zero_gaps)),
        "refused": t.refused,
        "statuses": t.statuses,
        "harness_cpu_util": round((marks["h1"] - marks["h0"]) / window, 3),
        "others": _others(target, marks, window),
    }
    if target.proc is not None:
        out["cpu_s"] = round(gateway_cpu, 3)
        out["cpu_util"] = round(gateway_cpu / window, 3)
        out["cpu_us_per_chunk"] = rounded(gateway_cpu / t.chunks * 1e6) if t.chunks else None
    return out


def _others(target: Target, marks: dict[str, float], window: float) -> dict[str, float]:
    """Per CPU, the share of the window the machine's other work took: CPU 0 minus the
    harness, the gateway's CPU minus the gateway (an unpinned gateway: both CPUs together,
    in CPUs' worth)."""

    def busy(cpu: int) -> float:
        return marks[f"cpu{cpu}_1"] - marks[f"cpu{cpu}_0"]

    harness, gateway = marks["h1"] - marks["h0"], marks["g1"] - marks["g0"]
    driver = os.sched_getaffinity(0)  # the driver pinned itself to the harness CPU
    gateway_cpus = target.proc.cpus if target.proc is not None and target.proc.cpus else set()
    if len(driver) != 1:
        return {}
    if len(gateway_cpus) > 1:
        other = sum(busy(c) for c in gateway_cpus | driver) - harness - gateway
        return {"cpus": round(max(0.0, other) / window, 3)}
    used = {min(driver): harness}
    for cpu in gateway_cpus:
        used[cpu] = used.get(cpu, 0.0) + gateway
    return {f"cpu{c}": round(max(0.0, busy(c) - u) / window, 3) for c, u in sorted(used.items())}


def rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


# ---- concurrency levels, interleaved -------------------------------------------------------


def burst_levels(prof: Profile) -> tuple[int, ...]:
    """The levels a burst runs at: a burst of one stream is the staggered run, so not 1."""
    levels = prof.levels if prof.burst_every_level else (max(prof.levels),)
    return tuple(k for k in levels if k > 1)


async def levels(
    targets: list[Target], prof: Profile, log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Every mode, level and arm, `prof.repeats` times, interleaved; the raw runs."""
    runs = []
    for rep in range(prof.repeats):
        for mode in prof.modes:
            settle = prof.burst_settle_s if mode == "burst" else None
            for level in burst_levels(prof) if mode == "burst" else prof.levels:
                for target in targets:
                    run = await measure(target, level, prof.window_s, prof.warmup_s, settle)
                    run["repeat"] = rep
                    runs.append(run)
                    log(line(run))
                    await asyncio.sleep(0.3)
    return runs


def line(run: dict[str, Any]) -> str:
    """One run as a progress line."""
    cpu = f" cpu {run['cpu_util']:.0%} {run['cpu_us_per_chunk']} us/chunk" if "cpu_s" in run else ""
    burst = (
        f" (burst {run['burst_ttft_p50_ms']} / {run['burst_ttft_p99_ms']}, written in "
        f"{run['burst_write_ms']} ms)"
        if run.get("mode") == "burst"
        else ""
    )
    return (
        f"  {run.get('mode', 'staggered')[:5]} {run['arm']:>14} x{run['streams']:<5} "
        f"{run['chunks_per_s']:>7} chunks/s  ttft p50 {run['ttft_p50_ms']} p99 "
        f"{run['ttft_p99_ms']} ms{burst}  gap p99 {run['gap_p99_ms']} ms"
        f"{cpu}  harness {run['harness_cpu_util']:.0%}  refused {run['refused']}"
    )


_MEDIANS = (
    "chunks_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "gap_p99_ms",
    "cpu_util",
    "cpu_us_per_chunk",
    "harness_cpu_util",
)
_ADDED = ("ttft_p50_ms", "ttft_p99_ms", "gap_p99_ms")
_BURST_MEDIANS = ("burst_ttft_p50_ms", "burst_ttft_p99_ms", "burst_write_ms")
_BURST_ADDED = ("burst_ttft_p50_ms", "burst_ttft_p99_ms")


def summarise_levels(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode, level and arm: medians over repeats, and the added figures against direct.

    Runs from before the burst mode carry no mode: they are staggered."""
    mode_of = [r.get("mode", "staggered") for r in runs]
    direct = {
        (m, r["repeat"], r["streams"]): r
        for m, r in zip(mode_of, runs, strict=True)
        if r["arm"] == "direct"
    }
    rows = []
    for mode in dict.fromkeys(mode_of):
        burst = mode == "burst"
        ran = [r for m, r in zip(mode_of, runs, strict=True) if m == mode]
        for level in sorted({r["streams"] for r in ran}):
            for arm in dict.fromkeys(r["arm"] for r in ran):
                mine = [r for r in ran if r["arm"] == arm and r["streams"] == level]
                row: dict[str, Any] = {
                    "mode": mode,
                    "arm": arm,
                    "streams": level,
                    "repeats": len(mine),
                }
                for key in _MEDIANS + (_BURST_MEDIANS if burst else ()):
                    row[key] = _median([r.get(key) for r in mine])
                for key in _ADDED + (_BURST_ADDED if burst else ()):
                    added = [
                        minus(r.get(key), direct[(mode, r["repeat"], level)].get(key)) for r in mine
                    ]
                    row["added_" + key] = _median(added)
                    present = [a for a in added if a is not None]
                    row[f"added_{key}_range"] = (
                        [rounded(min(present)), rounded(max(present))] if present else None
                    )
                for cpu in sorted({c for r in mine for c in r["others"]}):
                    row[f"others_{cpu}"] = _median([r["others"].get(cpu) for r in mine])
                row["offered_chunks_per_s"] = offered(level)
                row["ttft_n"] = sum(r["ttft_n"] for r in mine)
                row["refused"] = sum(r["refused"] for r in mine)
                rows.append(row)
    return rows


def minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _median(values: list[Any]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


# ---- memory per idle open stream -----------------------------------------------------------


async def memory(
    start: Callable[[], procs.Proc], k: int, prof: Profile, log: Callable[[str], None]
) -> dict[str, Any]:
    """Open `k` streams that got their first token and then hold; the gateway's VmRSS growth.

    The gateway is a fresh process, warmed by a second of light traffic, so that "before" is
    a server that has served but holds nothing.
    """
    proc = start()
    try:
        warm = Target(proc.name, proc.port, proc, ())
        await measure(warm, 8, 1.0, 1.1)
        await asyncio.sleep(1.0)
        before = procs.rss_bytes(proc.pid)
        payload = clients.request_bytes(proc.port, TOKENS, TTFT_MS, ITL_MS, hold=True)
        began = time.perf_counter()
        conns, tally = await clients.hold_open(proc.port, k, payload)
        opened = time.perf_counter() - began
        await asyncio.sleep(prof.hold_settle_s)
        during = procs.rss_bytes(proc.pid)
        await clients.close_all(conns)
        closed = time.perf_counter() - began - opened - prof.hold_settle_s
    finally:
        stopping = time.perf_counter()
        proc.stop()
        stopped = time.perf_counter() - stopping
    row = {
        "arm": proc.name,
        "streams": k,
        "first_tokens": len(tally.ttfts),
        "refused": tally.refused,
        "statuses": tally.statuses,
        "rss_before_mib": round(before / 2**20, 1),
        "rss_open_mib": round(during / 2**20, 1),
        "kib_per_stream": round((during - before) / k / 1024, 2),
        "open_s": round(opened, 1),
        "close_s": round(closed, 1),
        "stop_s": round(stopped, 1),
    }
    log(
        f"  {row['arm']:>8} {k} held: {row['first_tokens']} first tokens, RSS "
        f"{row['rss_before_mib']} -> {row['rss_open_mib']} MiB = {row['kib_per_stream']} KiB "
        f"per stream, refused {row['refused']} (open {opened:.1f} s, close {closed:.1f} s, "
        f"stop {stopped:.1f} s)"
    )
    return row


# ---- relay workers -------------------------------------------------------------------------


async def workers(
    config: Path,
    counts: list[int],
    streams: int,
    pins: dict[str, set[int]],
    harness: tuple[int, ...],
    prof: Profile,
    logdir: Path,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """llmflow with `--workers N` at `streams`: pinned to the gateway CPU for N=1, on every
    CPU otherwise (the harness then shares CPU 0 with it); runs interleaved over repeats."""
    runs = []
    for rep in range(prof.repeats):
        for n in counts:
            cpus = pins["gateway"] if n == 1 else pins["all"]
            proc = procs.start_llmflow(config, cpus, logdir, workers=n)
            try:
                run = await measure(
                    Target(f"llmflow-w{n}", proc.port, proc, harness),
                    streams,
                    prof.window_s,
                    prof.warmup_s,
                )
                run["threads"] = procs.threads(proc.pid)
            finally:
                proc.stop()
            run.update(workers=n, repeat=rep, cpus=sorted(cpus))
            runs.append(run)
            log(line(run) + f"  (--workers {n}, CPUs {sorted(cpus)})")
    return runs


def summarise_workers(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per N: the medians of chunk rate, CPU per chunk, utilisation and gap p99."""
    rows = []
    for n in dict.fromkeys(r["workers"] for r in runs):
        mine = [r for r in runs if r["workers"] == n]
        row: dict[str, Any] = {"workers": n, "cpus": mine[0]["cpus"], "repeats": len(mine)}
        for key in ("chunks_per_s", "cpu_us_per_chunk", "cpu_util", "gap_p99_ms", "ttft_p99_ms"):
            row[key] = _median([r.get(key) for r in mine])
        row["others"] = {
            cpu: _median([r["others"].get(cpu) for r in mine])
            for cpu in sorted({c for r in mine for c in r["others"]})
        }
        row["refused"] = sum(r["refused"] for r in mine)
        rows.append(row)
    return rows
