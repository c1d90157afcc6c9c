"""The simulator's commands: `llmflow sim run|list|tune|fidelity` and `llmflow simserve`.

`add_commands(subparsers)` registers them on the `llmflow` parser; each sets `func`, a callable
taking the parsed arguments and returning the exit status.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

__all__ = ["add_commands"]


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `sim` (with `run`, `list` and `tune`) and `simserve` on the `llmflow` parser."""
    sim = subparsers.add_parser(
        "sim", help="replay scenarios and incidents in the simulator",
        description="Simulate vLLM backends under a workload and compare policies: direct "
        "(no gateway), seed-gate (16 per GPU, 200 waiting, FIFO) and llmflow (the full policy), "
        "all driven by the same Rust core as the gateway.")
    sim_sub = sim.add_subparsers(title="sim commands", metavar="SIMCOMMAND")
    run = sim_sub.add_parser(
        "run", help="run a scenario and compare its policies",
        description="Run SCENARIO (a YAML path, or a name under sim/scenarios or sim/incidents) "
        "for each policy on the same requests, print a comparison table, and write report.json, "
        "report.md, timeseries.png and ttft_cdf.png to --out. Same seed, same numbers.")
    run.add_argument("scenario", metavar="SCENARIO", help="scenario YAML file or name")
    run.add_argument("--policy", action="append", metavar="NAME",
                     help="run only this policy (repeatable; default: all the scenario defines)")
    run.add_argument("--seed", type=int, help="random seed (default: the scenario's)")
    run.add_argument("--out", type=Path, metavar="DIR",
                     help="output folder (default: sim-out/<scenario name>)")
    run.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    run.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    run.add_argument("--trace", type=Path, metavar="FILE",
                     help="record each gated policy's runtime (every event and the actions it "
                     "gave) as JSON lines to FILE, or to FILE with -<policy> before its suffix "
                     "when several gated policies run; check it with `llmflow trace replay`")
    run.add_argument("--requests-out", type=Path, metavar="FILE",
                     help="write one row per request (class, tenant, arrival, attempts, "
                     "admission, first token, end, tokens, outcome, reason, backend) to FILE, "
                     ".csv or .parquet (needs pyarrow), or to FILE with -<policy> before its "
                     "suffix when several policies run; the gateway's server.access_log has "
                     "the same columns")
    run.set_defaults(func=_run)
    lst = sim_sub.add_parser("list", help="list the scenarios and incidents",
                             description="List the scenario files found under sim/scenarios "
                             "and sim/incidents, with their titles.")
    lst.set_defaults(func=_list)
    fid = sim_sub.add_parser(
        "fidelity", help="replay every stored fidelity case and compare with its real runs",
        description="Simulate each case under CASES (a folder with scenario.yaml and the real "
        "system's real.json) and print, figure by figure, the real median, the real runs' range, "
        "the simulated value, the error ln(sim/real), how far the simulation lies outside the "
        "real range, and issue 30's goal where one applies (docs/fidelity.md).")
    fid.add_argument("--cases", type=Path, metavar="DIR",
                     help="folder of cases (default: sim/fidelity-cases of this checkout)")
    fid.add_argument("--out", type=Path, metavar="FILE", help="also write the table here")
    fid.set_defaults(func=_fidelity)
    from llmflow.sim.tuning.cli import add_tune

    add_tune(sim_sub)

    def _sim_help(_args: argparse.Namespace) -> int:
        sim.print_help()
        return 2

    sim.set_defaults(func=_sim_help)

    serve = subparsers.add_parser(
        "simserve", help="serve a simulated vLLM (OpenAI API) in real time",
        description="Run the engine model in real time behind vLLM's HTTP surface: "
        "/v1/completions, /v1/chat/completions (streaming or not, ignore_eos, priority), "
        "/v1/responses, /v1/embeddings, /tokenize, /detokenize, /score, /rerank, "
        "/v1/audio/transcriptions, /v1/models, /health and /metrics with vLLM's metric names. "
        "A client disconnect aborts its request. No GPU needed.")
    serve.add_argument("--preset", default="h100:llama-3-8b", metavar="GPU:MODEL[:TP]",
                       help="hardware and model to imitate (default h100:llama-3-8b); GPUs: "
                       "a100-80g, h100, h200, l40s; models: llama-3-8b, llama-3-70b, "
                       "qwen2.5-32b, llama-2-7b")
    serve.add_argument("--speed", type=float, default=1.0, metavar="X",
                       help="simulated seconds per wall second (2 = twice as fast as the GPU)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    serve.add_argument("--port", type=int, required=True, metavar="P", help="port to listen on")
    serve.add_argument("--model-name", help="served model name (default: the preset's model)")
    serve.add_argument("--max-model-len", type=int, default=8192, help="context limit, tokens")
    serve.add_argument("--max-num-seqs", type=int, default=256, help="vLLM's max_num_seqs")
    serve.add_argument("--num-gpu-blocks", type=int,
                       help="KV capacity in blocks (default: derived from GPU memory)")
    serve.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                       help="vLLM's scheduling policy")
    serve.add_argument("--seed", type=int, default=0, help="seed of the simulated EOS lengths")
    kv = serve.add_argument_group(
        "P/D disaggregation", "Act as vLLM with the NIXL KV connector (kv_role kv_both): a "
        "request with kv_transfer_params.do_remote_decode keeps its KV blocks after it ends and "
        "answers the kv_transfer_params a decode needs; one with do_remote_prefill pulls the "
        "prompt's KV from that server (POST /_sim/kv/pull on its HTTP port) over this server's "
        "inbound link, and recomputes the prompt if the pull fails. Without --kv-transfer, "
        "kv_transfer_params are ignored (answered null).")
    kv.add_argument("--kv-transfer", action="store_true",
                    help="enable the KV connector (both the prefill and the decode side)")
    kv.add_argument("--kv-link-gb-s", type=float, default=25.0, metavar="GB_S",
                    help="inbound KV link bandwidth, GB/s (decimal; default 25, a 200 Gb/s "
                    "NIC); transfers share it one after another")
    kv.add_argument("--kv-link-latency-ms", type=float, default=1.0, metavar="MS",
                    help="added to each KV transfer (default 1)")
    kv.add_argument("--kv-hold-timeout-s", type=float, default=480.0, metavar="S",
                    help="simulated seconds a prefill keeps KV nobody pulls before freeing it "
                    "(vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT, default 480)")
    kv.add_argument("--kv-side-channel-host", metavar="HOST",
                    help="remote_host to answer (default: the address each request came in "
                    "on; vLLM's VLLM_NIXL_SIDE_CHANNEL_HOST)")
    kv.add_argument("--kv-engine-id", metavar="ID",
                    help="remote_engine_id to answer (default: a fresh UUID)")
    serve.set_defaults(func=_serve)


def _run(args: argparse.Namespace) -> int:
    from llmflow.config import ConfigFileError
    from llmflow.request_log import check_path, write_rows
    from llmflow.sim.report import render_table, write_reports
    from llmflow.sim.runner import run_scenario, trace_paths
    from llmflow.sim.scenario import ScenarioError, find_scenario, load_scenario

    try:
        path = find_scenario(args.scenario)
        sc = load_scenario(path)
        if args.trace is not None:
            args.trace.parent.mkdir(parents=True, exist_ok=True)
        if args.requests_out is not None:
            check_path(args.requests_out)  # before the run, not after it
        t0 = time.perf_counter()
        report, runs = run_scenario(sc, args.policy, args.seed, progress=not args.no_progress,
                                    trace=args.trace)
    except (FileNotFoundError, ScenarioError, ConfigFileError, KeyError, ValueError) as exc:
        print(f"error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    wall = time.perf_counter() - t0
    print(render_table(report), end="")
    out = args.out or Path("sim-out") / path.stem
    written = write_reports(sc, report, out)
    if not args.no_plots:
        from llmflow.sim.plots import write_plots

        written += write_plots(runs, out, sc.title)
    written += [r.trace for r in runs if r.trace is not None]
    if args.requests_out is not None:
        for name, p in trace_paths(args.requests_out, [r.name for r in runs]).items():
            write_rows(p, next(r for r in runs if r.name == name).requests)
            written.append(p)
    if args.trace is not None and not any(r.trace for r in runs):
        print("note: no gated policy ran, so no trace was written", file=sys.stderr)
    steps = sum(p["engine_steps"] for p in report["policies"].values())
    print(f"\n{len(runs)} policies, {report['requests']} requests each, {steps} engine steps "
          f"in {wall:.2f} s wall; wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    return 0


def _fidelity(args: argparse.Namespace) -> int:
    from llmflow.sim.fidelity import render, report
    from llmflow.sim.scenario import search_roots

    root = args.cases
    if root is None:
        found = [r / "sim" / "fidelity-cases" for r in search_roots()]
        root = next((f for f in found if f.is_dir()), Path("sim/fidelity-cases"))
    try:
        table = render(report(root))
    except (FileNotFoundError, ValueError) as exc:
        print(f"llmflow sim fidelity: {exc}", file=sys.stderr)
        return 2
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n", encoding="utf-8")
    return 0


def _list(_args: argparse.Namespace) -> int:
    from llmflow.sim.scenario import ScenarioError, all_scenarios, load_scenario

    for f in all_scenarios():
        try:
            title = load_scenario(f).title
        except ScenarioError as exc:
            title = f"(invalid: {exc.args[0].splitlines()[0]})"
        print(f"{f.parent.name}/{f.stem:<28} {title}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from llmflow.sim.server import KvTransfer, create_app

    try:
        kv = KvTransfer(bandwidth_gb_s=args.kv_link_gb_s, latency_ms=args.kv_link_latency_ms,
                        hold_timeout_s=args.kv_hold_timeout_s,
                        side_channel_host=args.kv_side_channel_host,
                        engine_id=args.kv_engine_id) if args.kv_transfer else None
        app = create_app(preset=args.preset, speed=args.speed, model=args.model_name,
                         max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                         num_gpu_blocks=args.num_gpu_blocks,
                         scheduling_policy=args.scheduling_policy, seed=args.seed,
                         kv_transfer=kv)
    except (KeyError, ValueError) as exc:
        print(f"error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
