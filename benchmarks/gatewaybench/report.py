"""The markdown tables (what `docs/benchmarks.md` shows) and the PNG charts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

_GATEWAYS = ("llmflow", "router")
_COLOURS = {"llmflow": "tab:blue", "router": "tab:orange", "direct": "tab:gray"}


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
        "",
        _levels_table(r["levels"]),
    ]
    if r.get("peak"):
        parts += ["", _peak_table(r["peak"])]
    if r.get("memory"):
        parts += ["", _memory_table(r["memory"])]
    if r.get("workers"):
        parts += ["", _workers_table(r["workers"])]
    elif r.get("workers_note"):
        parts += ["", f"Relay workers: {r['workers_note']}"]
    return "\n".join(parts)


def _range(pair: Any) -> str:
    return "-" if not pair else f"{pair[0]:,.1f} - {pair[1]:,.1f}"


def _load(avg: Any) -> str:
    return "-" if not avg else " / ".join(f"{x:.1f}" for x in avg)


def _levels_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| streams (offered chunks/s) | arm | TTFT p50 / p99 (ms) | added TTFT p50 / p99 (ms) "
        "| added TTFT p50, repeats' min-max (ms) "
        "| gap p99 (ms) | added gap p99 (ms) | chunks/s | CPU per chunk (us) | gateway CPU "
        "| others' load on CPU 0 / 1 | refused |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        gateway = row["arm"] != "direct"
        out.append(
            f"| {row['streams']:,} ({row['offered_chunks_per_s']:,.0f}) | {row['arm']} "
            f"| {_pair(row['ttft_p50_ms'], row['ttft_p99_ms'])} "
            f"| {_pair(row['added_ttft_p50_ms'], row['added_ttft_p99_ms']) if gateway else ''} "
            f"| {_range(row.get('added_ttft_p50_ms_range')) if gateway else ''} "
            f"| {_f(row['gap_p99_ms'])} "
            f"| {_f(row['added_gap_p99_ms']) if gateway else ''} "
            f"| {row['chunks_per_s']:,.0f} "
            f"| {_f(row['cpu_us_per_chunk']) if gateway else ''} "
            f"| {_f(row['cpu_util'], '{:.0%}') if gateway else ''} "
            f"| {_others(row)} | {row['refused']} |"
        )
    return "\n".join(out)


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
    """Added TTFT (p50, p99) and chunk rate / CPU per chunk against concurrency, llmflow and
    the router side by side; returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outdir.mkdir(parents=True, exist_ok=True)
    rows, title = r["levels"], f"llmflow {r['meta']['commit']} vs vllm-router"
    paths = [outdir / "gateway-added-ttft.png", outdir / "gateway-chunks-cpu.png"]

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for ax, key, label in zip(
        axes, ("added_ttft_p50_ms", "added_ttft_p99_ms"), ("p50", "p99"), strict=True
    ):
        for arm in _GATEWAYS:
            _line(ax, rows, arm, key)
        ax.set(title=f"added TTFT {label}", ylabel="ms over direct", xlabel="concurrent streams")
        ax.set_yscale("symlog", linthresh=1.0)
        _axes(ax, rows)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for arm in ("direct", *_GATEWAYS):
        _line(axes[0], rows, arm, "chunks_per_s")
    levels = sorted({row["streams"] for row in rows})
    axes[0].plot(levels, [x * 100 for x in levels], ":", color="black", label="offered")
    axes[0].set(title="delivered chunks/s", ylabel="chunks/s", xlabel="concurrent streams")
    for arm in _GATEWAYS:
        _line(axes[1], rows, arm, "cpu_us_per_chunk")
    axes[1].set(title="gateway CPU per chunk", ylabel="us", xlabel="concurrent streams")
    for ax in axes:
        _axes(ax, rows)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close("all")
    return paths


def _line(ax: Any, rows: list[dict[str, Any]], arm: str, key: str) -> None:
    mine = [row for row in rows if row["arm"] == arm and row.get(key) is not None]
    if mine:
        x, y = [row["streams"] for row in mine], [row[key] for row in mine]
        ax.plot(x, y, "o-", color=_COLOURS[arm], label=arm)


def _axes(ax: Any, rows: list[dict[str, Any]]) -> None:
    levels = sorted({row["streams"] for row in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(x) for x in levels])
    ax.minorticks_off()
    ax.grid(True, alpha=0.3)
    ax.legend()
