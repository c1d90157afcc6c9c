"""The markdown tables (what `docs/benchmarks.md` shows) and the PNG charts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

_GATEWAYS = ("llmflow", "llmflow-native", "llmflow-base", "router")
_COLOURS = {
    "llmflow": "tab:blue",
    "llmflow-native": "tab:green",
    "llmflow-base": "tab:purple",
    "router": "tab:orange",
    "direct": "tab:gray",
}
_MODE_TITLES = {
    "staggered": "Staggered starts (the streams start evenly over one request period):",
    "burst": "Burst starts (every connection opened and warmed by one unmeasured burst, then "
    "every stream's request written in one loop: *the burst*; then closed loop, so the later "
    "requests come in waves too; TTFT: every request from the burst on):",
}


def _f(value: Any, fmt: str = "{:,.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _pair(a: Any, b: Any, fmt: str = "{:,.1f}") -> str:
    return f"{_f(a, fmt)} / {_f(b, fmt)}"


def markdown(r: dict[str, Any]) -> str:
    """Every table of one run, ready to paste under docs/benchmarks.md's Gateway section."""
    meta = r["meta"]
    nice = f", nice {meta['nice']}" if meta.get("nice") else ""
    parts = [
        f"Run {meta['date']}, llmflow `{meta['commit']}`, vllm-router {meta['router_version']}, "
        f"{meta['machine']}; {meta['pinning']}{nice}. "
        f"Command: `{meta['command']}`. Load average at start {_load(meta['load_avg_start'])}, "
        f"at end {_load(meta.get('load_avg_end'))}.",
    ]
    for note in [*r.get("front_notes", []), r.get("router_note")]:
        parts += ["", f"NOTE: {note}"] if note else []
    parts += ["", _goals_table(r)]
    for mode in dict.fromkeys(row.get("mode", "staggered") for row in r["levels"]):
        rows = [row for row in r["levels"] if row.get("mode", "staggered") == mode]
        parts += ["", _MODE_TITLES[mode], "", _levels_table(rows, burst=mode == "burst")]
    if r.get("peak"):
        parts += ["", _peak_table(r["peak"])]
    if r.get("memory"):
        parts += ["", _memory_table(r["memory"])]
    if r.get("workers"):
        parts += ["", _workers_table(r["workers"])]
    elif r.get("workers_note"):
        parts += ["", f"Relay workers: {r['workers_note']}"]
    return "\n".join(parts)


def _goals_table(r: dict[str, Any]) -> str:
    """Issue 23's goals, per llmflow arm, from this run's medians (`-`: not measured here)."""
    levels = r["levels"]
    top = max(row["streams"] for row in levels)

    def row_of(arm: str, mode: str, streams: int) -> dict[str, Any]:
        return next(
            (
                row
                for row in levels
                if row["arm"] == arm
                and row["streams"] == streams
                and row.get("mode", "staggered") == mode
            ),
            {},
        )

    held = max((m["streams"] for m in r.get("memory", [])), default=None)
    memory = {m["arm"]: m for m in r.get("memory", []) if m["streams"] == held}
    peaks = {p["arm"]: p for p in r.get("peak", [])}
    router_cpu = row_of("router", "staggered", top).get("cpu_us_per_chunk")
    out = [
        f"Issue 23's goals (medians over repeats; added = arm - direct of the same repeat; "
        f"at {top:,} streams; the router's row for comparison; the flood's goals are "
        "`benchmarks/flood_floor.py`'s):",
        "",
        "| arm | added TTFT at 1 stream, p50 (<= 1 ms) "
        "| added TTFT, staggered, p50 / p99 (<= 2 / 10 ms) "
        "| added TTFT, the burst's requests, p50 / p99 (<= 2 / 10 ms) "
        "| CPU per chunk, staggered, x the router's (<= 1.0) "
        f"| KiB per idle open stream at {_f(held, '{:,}')} (<= 40) | peak streams |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for arm in dict.fromkeys(row["arm"] for row in levels):
        if arm == "direct":
            continue
        one, stag, burst = (
            row_of(arm, "staggered", 1),
            row_of(arm, "staggered", top),
            row_of(arm, "burst", top),
        )
        cpu = stag.get("cpu_us_per_chunk")
        ratio = cpu / router_cpu if cpu is not None and router_cpu else None
        peak, judge = peaks.get(arm), arm != "router"
        out.append(
            f"| {arm} | {_goal(one.get('added_ttft_p50_ms'), 1.0, judge)} "
            f"| {_goal2(stag, 'added_ttft', judge)} "
            f"| {_goal2(burst, 'added_burst_ttft', judge)} "
            f"| {_goal(ratio, 1.0, judge, '{:.2f}x') if judge else ''} "
            f"| {_goal(memory.get(arm, {}).get('kib_per_stream'), 40.0, judge)} "
            f"| {_f(peak and peak['streams'], '{:,}')} |"
        )
    return "\n".join(out)


def _goal(value: float | None, limit: float, judge: bool, fmt: str = "{:,.1f}") -> str:
    if value is None:
        return "-"
    return fmt.format(value) + (f" ({'met' if value <= limit else 'missed'})" if judge else "")


def _goal2(row: dict[str, Any], key: str, judge: bool) -> str:
    p50, p99 = row.get(key + "_p50_ms"), row.get(key + "_p99_ms")
    if p50 is None or p99 is None:
        return "-"
    verdict = f" ({'met' if p50 <= 2.0 and p99 <= 10.0 else 'missed'})" if judge else ""
    return f"{p50:,.1f} / {p99:,.1f}{verdict}"


def _range(pair: Any) -> str:
    return "-" if not pair else f"{pair[0]:,.1f} - {pair[1]:,.1f}"


def _load(avg: Any) -> str:
    return "-" if not avg else " / ".join(f"{x:.1f}" for x in avg)


def _levels_table(rows: list[dict[str, Any]], burst: bool = False) -> str:
    burst_cols = (
        "| the burst's TTFT p50 / p99 (ms) | added (ms) | burst written in (ms) " if burst else ""
    )
    out = [
        "| streams (offered chunks/s) | arm | TTFT p50 / p99 (ms) | added TTFT p50 / p99 (ms) "
        f"| added TTFT p50, repeats' min-max (ms) {burst_cols}"
        "| gap p99 (ms) | added gap p99 (ms) | chunks/s | CPU per chunk (us) | gateway CPU "
        "| others' load on CPU 0 / 1 | refused |",
        "|---|---|---:|---:|---:|" + "---:|" * (3 * burst) + "---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        gateway = row["arm"] != "direct"
        of_burst = (
            f"| {_pair(row['burst_ttft_p50_ms'], row['burst_ttft_p99_ms'])} "
            f"| {_added_burst(row) if gateway else ''} | {_f(row['burst_write_ms'], '{:.2f}')} "
            if burst
            else ""
        )
        out.append(
            f"| {row['streams']:,} ({row['offered_chunks_per_s']:,.0f}) | {row['arm']} "
            f"| {_pair(row['ttft_p50_ms'], row['ttft_p99_ms'])} "
            f"| {_pair(row['added_ttft_p50_ms'], row['added_ttft_p99_ms']) if gateway else ''} "
            f"| {_range(row.get('added_ttft_p50_ms_range')) if gateway else ''} {of_burst}"
            f"| {_f(row['gap_p99_ms'])} "
            f"| {_f(row['added_gap_p99_ms']) if gateway else ''} "
            f"| {row['chunks_per_s']:,.0f} "
            f"| {_f(row['cpu_us_per_chunk']) if gateway else ''} "
            f"| {_f(row['cpu_util'], '{:.0%}') if gateway else ''} "
            f"| {_others(row)} | {row['refused']} |"
        )
    return "\n".join(out)


def _added_burst(row: dict[str, Any]) -> str:
    return _pair(row["added_burst_ttft_p50_ms"], row["added_burst_ttft_p99_ms"])


def _others(row: dict[str, Any]) -> str:
    """What the machine's other work took from CPU 0 and the gateway's CPU, as shares."""
    shares = [row[k] for k in sorted(row) if k.startswith("others_cpu")]
    return " / ".join(_f(v, "{:.0%}") for v in shares) if shares else "-"


def _peak_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| arm | peak streams | offered chunks/s | delivered chunks/s | gateway CPU there "
        "| CPU 0 (harness) there | first failing streams | limited by |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        at, at_least = row["at_peak"], ">= " if row["bound"] != "gateway" else ""
        out.append(
            f"| {row['arm']} | {at_least}{row['streams']:,} "
            f"| {at_least}{row['offered_chunks_per_s']:,.0f} | {_f(at['chunks_per_s'], '{:,.0f}')} "
            f"| {_f(at['cpu_util'], '{:.0%}')} | {_f(at['harness_cpu_util'], '{:.0%}')} "
            f"| {_f(row['first_failure_streams'], '{:,}')} | {_BOUND[row['bound']]} |"
        )
    return "\n".join(out)


_BOUND = {
    "gateway": "the gateway (adds > 5 ms to gap p99)",
    "harness": "the harness (direct's own gap p99 > 15 ms)",
    "cap": "the search's cap",
}


def _memory_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| arm | idle open streams | VmRSS before -> open (MiB) | KiB per stream "
        "| got first token | refused |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        out.append(
            f"| {row['arm']} | {row['streams']:,} "
            f"| {row['rss_before_mib']:,.1f} -> {row['rss_open_mib']:,.1f} "
            f"| {row['kib_per_stream']:,.1f} | {row['first_tokens']:,} | {row['refused']} |"
        )
    return "\n".join(out)


def _workers_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| `--workers` | CPUs | chunks/s | CPU per chunk (us) | gateway CPU | gap p99 (ms) "
        "| TTFT p99 (ms) | others' load | refused |",
        "|---:|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for row in rows:
        out.append(
            f"| {row['workers']} | {','.join(map(str, row['cpus']))} "
            f"| {_f(row['chunks_per_s'], '{:,.0f}')} | {_f(row['cpu_us_per_chunk'])} "
            f"| {_f(row['cpu_util'], '{:.0%}')} | {_f(row['gap_p99_ms'])} "
            f"| {_f(row['ttft_p99_ms'])} "
            f"| {', '.join(f'{k} {v:.0%}' for k, v in row['others'].items() if v is not None)} "
            f"| {row['refused']} |"
        )
    return "\n".join(out)


# ---- charts --------------------------------------------------------------------------------


def charts(r: dict[str, Any], outdir: Path) -> list[Path]:
    """Added TTFT (p50, p99) and chunk rate / CPU per chunk against concurrency, every llmflow
    arm and the router side by side, staggered starts as solid lines and bursts dashed (their
    TTFT: the burst's own requests'); returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outdir.mkdir(parents=True, exist_ok=True)
    rows, title = r["levels"], f"llmflow {r['meta']['commit']} vs vllm-router"
    paths = [outdir / "gateway-added-ttft.png", outdir / "gateway-chunks-cpu.png"]

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for ax, label in zip(axes, ("p50", "p99"), strict=True):
        for arm in _GATEWAYS:
            _line(ax, rows, arm, f"added_ttft_{label}_ms")
            _line(ax, rows, arm, f"added_burst_ttft_{label}_ms", "burst")
        ax.set(title=f"added TTFT {label}", ylabel="ms over direct", xlabel="concurrent streams")
        ax.set_yscale("symlog", linthresh=1.0)
        _axes(ax, rows)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for arm in ("direct", *_GATEWAYS):
        _line(axes[0], rows, arm, "chunks_per_s")
        _line(axes[0], rows, arm, "chunks_per_s", "burst")
    levels = sorted({row["streams"] for row in rows})
    axes[0].plot(levels, [x * 100 for x in levels], ":", color="black", label="offered")
    axes[0].set(title="delivered chunks/s", ylabel="chunks/s", xlabel="concurrent streams")
    for arm in _GATEWAYS:
        _line(axes[1], rows, arm, "cpu_us_per_chunk")
        _line(axes[1], rows, arm, "cpu_us_per_chunk", "burst")
    axes[1].set(title="gateway CPU per chunk", ylabel="us", xlabel="concurrent streams")
    for ax in axes:
        _axes(ax, rows)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close("all")
    return paths


def _line(ax: Any, rows: list[dict[str, Any]], arm: str, key: str, mode: str = "staggered") -> None:
    mine = [
        row
        for row in rows
        if row["arm"] == arm and row.get("mode", "staggered") == mode and row.get(key) is not None
    ]
    if mine:
        x, y = [row["streams"] for row in mine], [row[key] for row in mine]
        style, label = ("o-", arm) if mode == "staggered" else ("s--", f"{arm}, burst")
        ax.plot(x, y, style, color=_COLOURS[arm], label=label)


def _axes(ax: Any, rows: list[dict[str, Any]]) -> None:
    levels = sorted({row["streams"] for row in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(x) for x in levels])
    ax.minorticks_off()
    ax.grid(True, alpha=0.3)
    ax.legend()
