"""Reports: the comparison table printed by `llmflow sim run`, `report.json` and `report.md`.

The table holds only simulated quantities (no wall-clock time), so it is the golden output the
`sim/` collector diffs. Verdicts judge each class against the SLO its scenario declares.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

from llmflow.sim.policies import policy_config

if TYPE_CHECKING:
    from pathlib import Path

    from llmflow.sim.scenario import Scenario

__all__ = ["dominance", "render_markdown", "render_table", "verdicts", "write_reports"]

# A rival beats llmflow on a metric only by more than this (relative): simulated figures move
# by fractions of a percent with the seed, and a tie is not a loss.
DOMINANCE_TOLERANCE = 0.01

_COLUMNS = ("policy", "class", "arrived", "completed", "rejected", "timed_out", "truncated",
            "cancelled", "unfinished", "ttft p50", "ttft p99", "e2e p99", "wait p99")


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, pol in report["policies"].items():
        for cls, c in pol["classes"].items():
            rows.append([
                name, cls, str(c["arrived"]), str(c["completed"]), str(c["rejected"]),
                str(c["timed_out"]), str(c["truncated"]), str(c["cancelled"]), str(c["unfinished"]),
                _s(c["ttft_s"]["p50"]), _s(c["ttft_s"]["p99"]), _s(c["e2e_s"]["p99"]),
                _s(c["queue_wait_s"]["p99"]),
            ])
    return rows


def _grid(header: tuple[str, ...] | list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:{'<' if i < 2 else '>'}{w}}}" for i, w in enumerate(widths))
    return [fmt.format(*header), *(fmt.format(*r) for r in rows)]


def render_table(report: dict[str, Any]) -> str:
    """The plain-text comparison (times in seconds, user-perceived, from the first attempt)."""
    lines = [f"scenario: {report['scenario']}  seed: {report['seed']}  "
             f"requests: {report['requests']}", ""]
    lines += _grid(_COLUMNS, _rows(report))
    lines.append("")
    head = ("policy", "peak run", "peak queue", "peak kv", "preempt", "goodput/s", "sim s",
            "busy q", "kept q", "verdict")
    rows = []
    for name, pol in report["policies"].items():
        verdict = pol.get("verdict", {}).get("summary", "")
        occ = pol.get("occupancy_while_queued") or {}
        rows.append([name, str(pol["peak_running"]), str(pol["peak_queue"]),
                     f"{pol['peak_kv_usage']:.3f}", str(pol["preemptions"]),
                     f"{pol['goodput_rps']:.3f}", f"{pol['sim_s']:.1f}",
                     _share(occ.get("busy")), _share(occ.get("reserved")), verdict])
    lines += _grid(head, rows)
    lines += _tpot_table(report)
    lines += _prefix_lines(report)
    if "dominance" in report:
        lines += ["", f"dominance: {report['dominance']['summary']}"]
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _tpot_table(report: dict[str, Any]) -> list[str]:
    """Time per output token and the requests within every SLO of their class, for the
    classes that declare a TPOT SLO."""
    names = report.get("tpot_classes")
    if not names:
        return []
    rows = []
    for name, pol in report["policies"].items():
        for cls in names:
            c = pol["classes"][cls]
            t = c["tpot_s"]
            good = c.get("within_slo", 0)
            share = f"{good / c['arrived']:.1%}" if c["arrived"] else "-"
            rows.append([name, cls, _ms(t["p50"]), _ms(t["p99"]), str(good), share])
    head = ("policy", "class", "tpot p50 ms", "tpot p99 ms", "within slo", "share")
    return ["", *_grid(head, rows)]


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _prefix_lines(report: dict[str, Any]) -> list[str]:
    """The routing table, for runs whose requests carried block hashes: each policy's
    prefix-cache hit rate and how evenly its requests spread over the backends."""
    pols = {name: pol["prefix"] for name, pol in report["policies"].items() if "prefix" in pol}
    if not pols:
        return []
    head = ("policy", "prefix hit", "max/mean", "requests per backend")
    rows = [[name, f"{p['hit_rate']:.1%}", f"{p['imbalance']:.3f}",
             " ".join(str(n) for n in p["requests_per_backend"])] for name, p in pols.items()]
    return ["", *_grid(head, rows)]


def _inf(x: float | None) -> float:
    return math.inf if x is None else x


def _contracted(sc: Scenario, ours: str) -> set[str]:
    """Tenants `ours` holds to a rate limit (`tokens_per_min`, `requests_per_s`)."""
    tenants = policy_config(ours, sc.policies[ours], sc)["tenants"]
    return {
        t["name"] for t in tenants
        if t.get("tokens_per_min") is not None or t.get("requests_per_s") is not None
    }


def dominance(sc: Scenario, report: dict[str, Any], ours: str = "llmflow") -> None:
    """Add a `dominance` block: does `ours` lose to any other policy on any metric that matters?

    The metrics: for each class with a TTFT SLO, its TTFT p99 counting requests that never got
    an answer as infinitely late (lower wins); for each class with a completion SLO, the share
    completed (higher wins); for each class without a latency SLO (batch work), when its last
    request completed, i.e. its makespan (earlier wins; a class that lost requests never
    finished); and total goodput (higher wins). A rival beats `ours` on a metric only by more
    than `DOMINANCE_TOLERANCE`.

    Rivals are the other policies: `direct` and the gated policies of another preset. A gated
    policy of `ours`' own preset with other settings (`llmflow-brownout`: answers clamped to
    300 tokens) is the operator's variant of the same policy, a trade the operator makes (the
    tuner's job, `llmflow sim tune`); where it beats the defaults is listed apart, under
    `variants`. A policy that runs on other hardware (its own `cluster:`, e.g. the same GPUs
    split into prefill and decode instances) is another deployment, not a rival: no policy
    turns two decode GPUs into four, so where it wins it is listed apart, under `layouts`. The
    makespan of a class whose tenant `ours` holds to a rate limit is not compared: the
    contract sets its pace, and finishing it sooner means breaking it.
    """
    pols = report["policies"]
    if ours not in pols or len(pols) < 2:
        return
    contracted = _contracted(sc, ours) if ours in sc.policies else set()

    def metrics(pol: dict[str, Any]) -> list[tuple[str, float, bool]]:
        out = []  # (name, value, higher is better)
        for wc in sc.workload:
            c = pol["classes"][wc.name]
            slo = wc.slo
            if slo is not None and slo.ttft_p99_s is not None:
                out.append((f"{wc.name} ttft p99", _inf(c["ttft_p99_lost_inf_s"]), False))
            if slo is not None and slo.min_completed_frac is not None:
                frac = c["completed"] / c["arrived"] if c["arrived"] else 1.0
                out.append((f"{wc.name} completed", frac, True))
            if wc.tenant in contracted:
                continue
            if slo is None or (slo.ttft_p99_s is None and slo.e2e_p99_s is None):
                lost = c["arrived"] - c["completed"] - c["cancelled"] - c["truncated"]
                done = math.inf if lost else _inf(c["last_done_s"])
                out.append((f"{wc.name} makespan", done, False))
        out.append(("goodput", pol["goodput_rps"], True))
        return out

    mine = metrics(pols[ours])
    beaten: list[str] = []
    variants: list[str] = []
    layouts: list[str] = []
    preset = sc.policies[ours].preset_for(ours) if ours in sc.policies else ours

    def hardware(name: str) -> list[Any]:
        spec = sc.policies.get(name)
        groups = spec.cluster if spec is not None and spec.cluster is not None else sc.cluster
        return [g.model_dump() for g in groups]

    for name, pol in pols.items():
        if name == ours:
            continue
        spec = sc.policies.get(name)
        variant = spec is not None and spec.kind == "gated" and spec.preset_for(name) == preset
        apart = layouts if hardware(name) != hardware(ours) else variants if variant else beaten
        for (metric, v_ours, higher), (_, v_them, _) in zip(mine, metrics(pol), strict=True):
            margin = DOMINANCE_TOLERANCE * (abs(v_ours) if math.isfinite(v_ours) else 1.0)
            better = v_them > v_ours + margin if higher else v_them < v_ours - margin
            if better:
                apart.append(f"{name} {metric} {_fmt(v_them)} vs {_fmt(v_ours)}")
    summary = f"{ours} dominates" if not beaten else f"{ours} beaten {len(beaten)}x: " + "; ".join(
        beaten)
    if contracted:
        summary += f" (makespan of {', '.join(sorted(contracted))} set by its rate limit)"
    if variants:
        summary += f"; its own variants win {len(variants)}x: " + "; ".join(variants)
    if layouts:
        summary += f"; other hardware layouts win {len(layouts)}x: " + "; ".join(layouts)
    report["dominance"] = {"policy": ours, "summary": summary, "beaten": beaten,
                           "variants": variants, "layouts": layouts}


def _fmt(x: float) -> str:
    return "inf" if not math.isfinite(x) else f"{x:.3f}"


def verdicts(sc: Scenario, report: dict[str, Any]) -> None:
    """Add a `verdict` block to each policy: per class, which declared SLOs held."""
    for pol in report["policies"].values():
        missed: list[str] = []
        checked = 0
        for wc in sc.workload:
            c = pol["classes"][wc.name]
            if wc.slo is None:
                continue
            for key, target, got in (
                ("ttft p99", wc.slo.ttft_p99_s, c["ttft_s"]["p99"]),
                ("e2e p99", wc.slo.e2e_p99_s, c["e2e_s"]["p99"]),
                ("tpot p99", wc.slo.tpot_p99_s, c["tpot_s"]["p99"]),
            ):
                if target is None:
                    continue
                checked += 1
                if got is None or got > target:
                    missed.append(f"{wc.name} {key} {_s(got)}s > {target}s")
            if wc.slo.min_completed_frac is not None:
                checked += 1
                frac = c["completed"] / c["arrived"] if c["arrived"] else 1.0
                if frac < wc.slo.min_completed_frac:
                    want = wc.slo.min_completed_frac
                    missed.append(f"{wc.name} completed {frac:.1%} < {want:.0%}")
        summary = "no SLO declared" if not checked else (
            "held" if not missed else f"missed {len(missed)}/{checked}")
        pol["verdict"] = {"summary": summary, "missed": missed}


def render_markdown(sc: Scenario, report: dict[str, Any]) -> str:
    """`report.md`: the tables plus a short verdict per policy."""
    out = [f"# {report['scenario']}", "",
           f"Seed {report['seed']}, {report['requests']} requests. Times are user-perceived "
           "seconds from a request's first attempt.", ""]
    rows = _rows(report)
    out.append("| " + " | ".join(_COLUMNS) + " |")
    out.append("|" + "---|" * len(_COLUMNS))
    out += ["| " + " | ".join(r) + " |" for r in rows]
    out += ["", "## Verdicts", ""]
    for name, pol in report["policies"].items():
        v = pol.get("verdict", {"summary": "", "missed": []})
        line = (f"- **{name}**: {v['summary']}. Peak running {pol['peak_running']} "
                f"on {pol['gpus']} GPUs, peak queue {pol['peak_queue']}, peak KV "
                f"{pol['peak_kv_usage']:.0%}, {pol['preemptions']} preemptions, goodput "
                f"{pol['goodput_rps']:.2f} req/s, {pol.get('browned_out', 0)} browned out "
                "(max_tokens clamped).")
        if v["missed"]:
            line += " Missed: " + "; ".join(v["missed"]) + "."
        out.append(line)
    out.append("")
    return "\n".join(out)


def write_reports(sc: Scenario, report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write `report.json` and `report.md` into `out_dir` (created if needed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "report.json", out_dir / "report.md"]
    paths[0].write_text(json.dumps(report, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    paths[1].write_text(render_markdown(sc, report), encoding="utf-8")
    return paths
