"""The `llmflow` command line: capacity estimates, config checks, the simulator and the gateway.

Each command group registers itself through an `add_commands(subparsers)` function, so this
module only assembles them.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from typing import TYPE_CHECKING

from llmflow import __version__, kv_slots
from llmflow.config import ConfigFileError, load_settings

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["build_parser", "main"]

_GB = 1e9  # capacity figures are in vendor GB, as GPU datasheets and the seed count them
_MB = 1e6
# Command groups living in their own packages: (module, why it may be missing).
_GROUPS = (
    "llmflow.sim.cli",
    "llmflow.trace_cli",
    "llmflow.gateway.cli",
    "llmflow.calibrate",
    "llmflow.conformance.cli",
)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    return int(args.func(args))


def build_parser() -> argparse.ArgumentParser:
    """The whole `llmflow` parser, every command with its `--help`."""
    parser = argparse.ArgumentParser(
        prog="llmflow",
        description="Traffic governor for self-hosted LLM inference in front of vLLM.",
    )
    parser.add_argument("--version", action="version", version=f"llmflow {__version__}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_capacity(sub)
    _add_config(sub)
    for module in _GROUPS:
        importlib.import_module(module).add_commands(sub)
    return parser


def _add_capacity(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "capacity",
        help="estimate concurrent KV slots per GPU (the seed's formula)",
        description=(
            "slots = (VRAM - weights - activations) / (avg_context * kv_bytes_per_token). "
            "Give the figures directly (defaults: the seed's example, 80 GB A100 with 64 GB of "
            "weights, 6 GB activations, 4,096-token contexts at ~1 MB per token), or name a "
            "--model and --gpu preset to derive weights and KV bytes per token from the shape."
        ),
    )
    p.add_argument("--vram-gb", type=float, help="GPU memory in GB (default 80, or the --gpu's)")
    p.add_argument("--weights-gb", type=float, help="weights per GPU in GB (default 64)")
    p.add_argument("--activations-gb", type=float, default=6.0, help="activations and reserve, GB")
    p.add_argument("--avg-context", type=int, default=4096, help="average context in tokens")
    p.add_argument("--kv-mb-per-token", type=float, help="KV MB per token per GPU (default 1)")
    p.add_argument("--model", help="model preset (llama-3-8b, llama-3-70b, qwen2.5-32b, ...)")
    p.add_argument("--gpu", help="GPU preset (a100-80g, h100, h200, l40s, l4, rtx-4090)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs the model spans")
    p.set_defaults(func=_run_capacity)


def _run_capacity(args: argparse.Namespace) -> int:
    from llmflow import presets

    try:
        gpu = presets.gpu(args.gpu) if args.gpu else None
        model = presets.model(args.model) if args.model else None
    except KeyError as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 2
    if args.tp < 1:
        print("error: --tp must be >= 1", file=sys.stderr)
        return 2
    vram = args.vram_gb * _GB if args.vram_gb is not None else (gpu.hbm_bytes if gpu else 80 * _GB)
    if args.weights_gb is not None:
        weights = args.weights_gb * _GB
    else:
        weights = model.weight_bytes / args.tp if model else 64 * _GB
    if args.kv_mb_per_token is not None:
        per_token = args.kv_mb_per_token * _MB
    else:
        per_token = float(model.kv_bytes_per_token(args.tp)) if model else 1 * _MB
    try:
        slots = kv_slots(vram, weights, args.activations_gb * _GB, args.avg_context, per_token)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    free = max(vram - weights - args.activations_gb * _GB, 0.0)
    print(f"VRAM per GPU        {vram / _GB:10.1f} GB")
    print(f"weights per GPU     {weights / _GB:10.1f} GB")
    print(f"activations         {args.activations_gb:10.1f} GB")
    print(f"left for KV cache   {free / _GB:10.1f} GB")
    print(f"KV per token        {per_token / 1024:10.1f} KiB per GPU")
    context_gb = args.avg_context * per_token / _GB
    print(f"KV per context      {context_gb:10.2f} GB ({args.avg_context} tokens)")
    print(f"slots               {math.floor(slots):10d}   ({slots:.2f} full contexts)")
    return 0


def _add_config(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("config", help="work with llmflow config files")
    config_sub = p.add_subparsers(title="config commands", metavar="COMMAND")
    check = config_sub.add_parser(
        "check",
        help="validate a YAML config file",
        description="Validate FILE; print each bad key with its value and what is allowed.",
    )
    check.add_argument("file", metavar="FILE", help="YAML config file")
    check.set_defaults(func=_run_config_check)
    verify = config_sub.add_parser(
        "verify",
        help="property-test the policy a config file sets (the runtime's state machine)",
        description="Run the runtime built from FILE under random traffic of FILE's own tenants "
        "(arrivals, tokens, failures, disconnects, slow readers, scrapes, timers, the drain) and "
        "check after every event: no leaked slot, queue entry or KV block; no request that "
        "never ends; no backend over its cap; no VIP refused while a less important tenant "
        "would get in; sane Retry-After; exact replay. A broken invariant is shrunk to a "
        "minimal event sequence and printed one event a line (exit 1); otherwise one pass "
        "line (exit 0). Caps and queues bind only when a run is long enough to fill them: "
        "raise --steps for large ones.",
    )
    verify.add_argument("file", metavar="FILE", help="YAML config file")
    verify.add_argument(
        "--examples", type=int, default=200, metavar="N", help="runs to try (default 200)"
    )
    verify.add_argument(
        "--steps", type=int, default=100, metavar="K", help="events per run (default 100)"
    )
    verify.add_argument(
        "--seed", type=int, default=0, help="seed; the same seed explores the same runs"
    )
    verify.add_argument(
        "--max-running",
        action="append",
        default=[],
        metavar="TENANT=N",
        help="an invariant of your own to check too: at most N requests of TENANT run at once "
        "(repeatable)",
    )
    verify.set_defaults(func=_run_config_verify)

    def show_help(_args: argparse.Namespace) -> int:
        p.print_help()
        return 2

    p.set_defaults(func=show_help)


def _run_config_check(args: argparse.Namespace) -> int:
    from llmflow import ConfigError, Governor

    try:
        settings = load_settings(args.file)
        Governor(settings.to_core())
    except (ConfigFileError, ConfigError) as exc:
        print(str(exc), file=sys.stderr)
        return 1
    tiers = ", ".join(t.name for t in settings.tiers)
    print(
        f"{args.file}: ok — {len(settings.backends)} backend(s), tiers [{tiers}], "
        f"{len(settings.tenants)} tenant(s), cap {settings.gate.max_concurrency_per_gpu}/GPU, "
        f"queue {settings.gate.queue.max_waiting}"
    )
    return 0


def _run_config_verify(args: argparse.Namespace) -> int:
    from llmflow import ConfigError
    from llmflow.verify.run import verify

    try:
        settings = load_settings(args.file)
        expected = _max_running(args.max_running, {t.name for t in settings.tenants})
        verdict = verify(settings, args.examples, args.seed, args.steps, expected)
    except (ConfigFileError, ConfigError, ValueError) as exc:
        print(str(exc), file=sys.stderr)
        return 2
    if verdict.passed:
        print(
            f"{args.file}: ok — {verdict.examples} runs of up to {args.steps} events "
            f"(seed {args.seed}, {verdict.seconds:.1f} s): no invariant broken"
        )
        return 0
    print(f"{args.file}: BROKEN — {verdict.invariant}")
    print(f"  {verdict.message}")
    print(f"minimal sequence ({len(verdict.steps)} events, after {verdict.examples} runs):")
    for line in verdict.steps:
        print(f"  {line}")
    return 1


def _max_running(pairs: list[str], tenants: set[str]) -> dict[str, int]:
    expected = {}
    for pair in pairs:
        tenant, _, most = pair.partition("=")
        if tenant not in tenants or not most.isdigit():
            raise ValueError(
                f"--max-running {pair!r}: write TENANT=N with a tenant of the config "
                f"({', '.join(sorted(tenants)) or 'none'}) and N >= 0"
            )
        expected[tenant] = int(most)
    return expected


if __name__ == "__main__":
    raise SystemExit(main())
