"""The one command: start the arms, run every phase, write the JSON, charts and tables."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.gatewaybench import backend, peak, phases, procs, report

if TYPE_CHECKING:
    from collections.abc import Callable

ROOT = Path(__file__).resolve().parents[2]
CAP = 5120  # llmflow slots and queue: every stream of every phase admitted (5,000 held)
BURST_ONLY_LEVEL = 256


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gateway_bench",
        description="llmflow's gateway against vllm-router and a direct connection, one run.",
    )
    p.add_argument("--quick", action="store_true", help="development run: a minute or two")
    p.add_argument(
        "--burst-only",
        action="store_true",
        help=f"only the {BURST_ONLY_LEVEL}-stream burst, llmflow and the router, "
        "3 repeats, outputs in /tmp: under 3 minutes",
    )
    p.add_argument(
        "--mode",
        default=",".join(phases.MODES),
        help="how each level's streams start: staggered (evenly over one request period), "
        "burst (together), or both (the default)",
    )
    p.add_argument("--levels", help="concurrency levels, e.g. 1,64,256 (default by profile)")
    p.add_argument("--repeats", type=int, help="interleaved repeats (default: 3, quick 1)")
    p.add_argument("--window", type=float, help="measured seconds per arm and level")
    p.add_argument(
        "--llmflow-workers",
        default="1,2",
        help="`llmflow serve --workers N` values to run at the top level ('' to skip)",
    )
    p.add_argument("--memory", help="idle open streams, e.g. 1000,5000 (default by profile)")
    p.add_argument(
        "--nice",
        type=int,
        default=0,
        help="run the driver and every server at this nice value (e.g. -10, needs root): on a "
        "shared machine the arms then lose less CPU to other work, which loses more to them",
    )
    p.add_argument(
        "--baseline",
        type=Path,
        metavar="DIR",
        help="another checkout's python/ directory (its llmflow and built extension), run as "
        "the arm llmflow-base beside this one: an A/B in one run",
    )
    p.add_argument("--no-router", action="store_true", help="leave vllm-router out")
    p.add_argument("--no-peak", action="store_true", help="skip the peak chunk-rate search")
    p.add_argument("--no-memory", action="store_true", help="skip the idle-stream memory phase")
    p.add_argument("--json", type=Path, help="result file (default by profile)")
    p.add_argument("--charts", type=Path, help="PNG directory (default: docs/img; quick: /tmp)")
    p.add_argument(
        "--render", type=Path, metavar="JSON", help="only redraw tables and charts from a result"
    )
    p.add_argument("--backend", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.burst_only:
        args.mode, args.levels = "burst", args.levels or str(BURST_ONLY_LEVEL)
        args.no_peak = args.no_memory = True
        args.llmflow_workers = ""
    args.modes = _choices(p, "--mode", args.mode, phases.MODES)
    return args


def _choices(
    p: argparse.ArgumentParser, flag: str, value: str, allowed: tuple[str, ...]
) -> tuple[str, ...]:
    picked = tuple(x.strip() for x in value.split(",") if x.strip())
    wrong = [x for x in picked if x not in allowed]
    if wrong or not picked:
        p.error(f"{flag}: {', '.join(wrong) or 'nothing'} is not one of {', '.join(allowed)}")
    return picked


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with `--backend PORT`, only the fake vLLM)."""
    args = parse(argv)
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    if args.backend:
        asyncio.run(backend.serve(args.backend))
        return 0
    if args.render:
        result = json.loads(args.render.read_text())
        if result.get("level_runs"):  # the summaries as this version of the script makes them
            result["levels"] = phases.summarise_levels(result["level_runs"])
        if result.get("worker_runs"):
            result["workers"] = phases.summarise_workers(result["worker_runs"])
        print(report.markdown(result))
        charts = report.charts(result, args.charts or ROOT / "docs" / "img")
        print("charts: " + ", ".join(str(p) for p in charts))
        return 0
    return asyncio.run(run(args))


def profile(args: argparse.Namespace) -> phases.Profile:
    """The quick or full profile, with any command-line overrides."""
    prof = phases.QUICK if args.quick else phases.FULL
    changes: dict[str, Any] = {}
    if args.levels:
        changes["levels"] = tuple(int(x) for x in args.levels.split(","))
    if args.repeats:
        changes["repeats"] = args.repeats
    if args.window:
        changes["window_s"] = args.window
    if args.memory:
        changes["memory_streams"] = tuple(int(x) for x in args.memory.split(","))
    changes["modes"] = args.modes
    return phases.Profile(**{**prof.__dict__, **changes})


def pinning() -> tuple[dict[str, set[int]], str]:
    """CPU 0 for the fake vLLM and the clients, CPU 1 for the gateway under test."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {"harness": set(cpus), "gateway": set(cpus), "all": set(cpus)}, "not pinned"
    pins = {"harness": {cpus[0]}, "gateway": {cpus[1]}, "all": set(cpus)}
    text = (
        f"fake vLLM and clients pinned to CPU {cpus[0]}, the gateway under test "
        f"(llmflow or vllm-router) to CPU {cpus[1]}"
    )
    return pins, text


def _meta(args: argparse.Namespace, prof: phases.Profile, pin_text: str) -> dict[str, Any]:
    def git(*cmd: str) -> str:
        out = subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, check=False)
        return out.stdout.strip()

    changed = git("status", "--porcelain", "--untracked-files=no", "python", "rust")
    dirty = "-dirty" if changed else ""
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git("rev-parse", "--short", "HEAD") + dirty,
        "command": " ".join(["python -m benchmarks.gateway_bench", *sys.argv[1:]]),
        "profile": "quick" if args.quick else "burst-only" if args.burst_only else "full",
        "settings": prof.__dict__,
        "machine": f"{os.cpu_count()} vCPU {model}, {mem:.0f} GiB, Linux {platform.release()}",
        "pinning": pin_text,
        "nice": args.nice,
        "router_version": procs.ROUTER_VERSION,
        "workload": f"first token at {phases.TTFT_MS:g} ms, then {phases.TOKENS - 1} tokens "
        f"{phases.ITL_MS:g} ms apart; closed-loop keep-alive streams",
        "load_avg_start": os.getloadavg(),
        "nofile": procs.raise_nofile(),
    }


def _log(line: str) -> None:
    print(line, flush=True)


async def run(args: argparse.Namespace) -> int:
    """Every phase, then the outputs."""
    started = time.monotonic()
    prof = profile(args)
    pins, pin_text = pinning()
    meta = _meta(args, prof, pin_text)
    os.sched_setaffinity(0, pins["harness"])
    if args.nice:
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)  # the servers inherit it
    router_exe, router_note = _router(args)
    logdir = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
    result: dict[str, Any] = {"meta": meta}
    with contextlib.ExitStack() as stack:
        fake = procs.start_backend(ROOT, pins["harness"], logdir)
        stack.callback(fake.stop)
        config_path = logdir / "llmflow.yaml"
        meta["llmflow_config"] = procs.llmflow_config(fake.port, CAP, config_path)
        harness = (fake.pid, os.getpid())
        arms = _Arms(fake.port, pins, harness, config_path, router_exe, logdir, args.baseline)
        await _timed_phases(args, prof, result, arms)
    if router_note:
        result["router_note"] = router_note
    meta["load_avg_end"] = os.getloadavg()
    meta["wall_s"] = round(time.monotonic() - started)
    return _outputs(args, result, logdir)


def _router(args: argparse.Namespace) -> tuple[Path | None, str]:
    if args.no_router:
        return None, "vllm-router left out (--no-router)"
    try:
        return procs.ensure_router(), ""
    except (OSError, subprocess.CalledProcessError) as exc:
        note = f"vllm-router=={procs.ROUTER_VERSION} could not be installed: {exc}"
        print(f"NOTE: {note}; the router arm is skipped", flush=True)
        return None, note


@dataclass
class _Arms:
    """What every phase needs to start the arms again."""

    backend_port: int
    pins: dict[str, set[int]]
    harness: tuple[int, ...]  # pids on the harness CPU (fake vLLM, this driver)
    config: Path  # llmflow's
    router_exe: Path | None
    logdir: Path
    baseline: Path | None = None  # another checkout's python/: the arm llmflow-base

    def starters(self) -> dict[str, Callable[[], procs.Proc]]:
        """A fresh gateway process per arm, pinned to the gateway CPU."""

        def llmflow() -> procs.Proc:
            return procs.start_llmflow(self.config, self.pins["gateway"], self.logdir)

        def router() -> procs.Proc:
            assert self.router_exe is not None
            return procs.start_router(
                self.router_exe, self.backend_port, self.pins["gateway"], self.logdir
            )

        def base() -> procs.Proc:
            return procs.start_llmflow(
                self.config,
                self.pins["gateway"],
                self.logdir,
                name="llmflow-base",
                pythonpath=self.baseline,
            )

        return {
            "llmflow": llmflow,
            **({"llmflow-base": base} if self.baseline else {}),
            **({"router": router} if self.router_exe else {}),
        }


def _start(starters: dict[str, Callable[[], procs.Proc]]) -> dict[str, procs.Proc]:
    """Every arm started; any failure stops the run."""
    running: dict[str, procs.Proc] = {}
    try:
        for name, start in starters.items():
            running[name] = start()
    except BaseException:
        for proc in running.values():
            proc.stop()
        raise
    return running


async def _timed_phases(
    args: argparse.Namespace, prof: phases.Profile, result: dict[str, Any], arms: _Arms
) -> None:
    starters = arms.starters()
    running = _start(starters)
    try:
        targets = [phases.Target("direct", arms.backend_port, None, arms.harness)]
        targets += [phases.Target(n, p.port, p, arms.harness) for n, p in running.items()]
        _log(
            f"== concurrency levels {prof.levels} ({', '.join(prof.modes)}; bursts at "
            f"{phases.burst_levels(prof)}), {prof.repeats} repeat(s), interleaved"
        )
        runs = await phases.levels(targets, prof, _log)
        result["level_runs"], result["levels"] = runs, phases.summarise_levels(runs)
        if args.no_peak:
            pass
        elif "staggered" not in prof.modes:
            _log("NOTE: peak chunk rate skipped: it searches with staggered starts")
        else:
            _log(f"== peak chunk rate: added gap p99 <= {peak.ADDED_GAP_LIMIT_MS:g} ms")
            result["peak"] = [
                await peak.search(t, targets[0], result["levels"], prof, _log) for t in targets[1:]
            ]
    finally:
        for proc in running.values():
            proc.stop()
    if not args.no_memory:
        _log(f"== memory per idle open stream: {prof.memory_streams}")
        result["memory"] = [
            await phases.memory(start, k, prof, _log)
            for k in prof.memory_streams
            for start in starters.values()
        ]
    await _workers(args, prof, result, arms)


async def _workers(
    args: argparse.Namespace, prof: phases.Profile, result: dict[str, Any], arms: _Arms
) -> None:
    counts = [int(x) for x in args.llmflow_workers.split(",") if x.strip()]
    if not counts:
        return
    if not procs.llmflow_workers_flag():
        note = (
            "skipped: this checkout's `llmflow serve --help` has no `--workers` option "
            f"(asked for {counts})"
        )
        _log(f"NOTE: relay workers {note}")
        result["workers_note"] = note
        return
    top = max(prof.levels)
    _log(f"== relay workers {counts} at {top} streams")
    runs = await phases.workers(
        arms.config, counts, top, arms.pins, arms.harness, prof, arms.logdir, _log
    )
    result["worker_runs"], result["workers"] = runs, phases.summarise_workers(runs)


def _outputs(args: argparse.Namespace, result: dict[str, Any], logdir: Path) -> int:
    scratch = args.quick or args.burst_only  # a development or check run: nothing in the repo
    quick_dir = Path(tempfile.gettempdir()) / "gateway-bench-quick"
    default_json = (quick_dir if scratch else ROOT / "benchmarks" / "results") / "gateway.json"
    json_path = args.json or default_json
    chart_dir = args.charts or (quick_dir if scratch else ROOT / "docs" / "img")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    charts = report.charts(result, chart_dir)
    result["charts"] = [str(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p) for p in charts]
    json_path.write_text(json.dumps(result, indent=1, default=sorted))
    print()
    print(report.markdown(result))
    print()
    print(f"JSON: {json_path}")
    print("charts: " + ", ".join(str(p) for p in charts))
    print(f"server logs: {logdir}  ({result['meta']['wall_s']} s in all)")
    bad = [
        f"{r['arm']} x{r['streams']}: {r['statuses'] or r['refused']}"
        for r in result.get("level_runs", [])
        + result.get("memory", [])
        + result.get("worker_runs", [])
        if r["arm"] != "direct" and r["refused"]
    ]
    if bad:
        print(f"INVALID: requests refused through a gateway in {len(bad)} runs: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
