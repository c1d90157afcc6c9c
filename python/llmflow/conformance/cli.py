"""The `llmflow conformance` command (start the backend or mirror a standing one, wait for the
gateway, print the table) and `llmflow conformance-backend` (the backend alone)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from llmflow.conformance.backend import MODEL, Backend, BackendServer
from llmflow.conformance.remote import RemoteBackend
from llmflow.conformance.report import failed, render, write_json
from llmflow.conformance.suite import Options, SuiteError, run

if TYPE_CHECKING:
    from collections.abc import Callable

    from llmflow.conformance.report import Row

__all__ = ["add_commands", "main", "serve_backend"]

_EPILOG = """\
The suite starts its own fake vLLM (model name "conformance") and prints its URL: configure
the gateway with that URL as its only backend (or give --backend-port and configure it ahead).
Exit status: 0 every applicable invariant passed, 1 one failed, 2 no verdict (the gateway
could not be driven). Example, against llmflow with a cap of 4 and a queue of 8:

  llmflow conformance http://127.0.0.1:8080 --backend-port 9100 --max-concurrency 4 \\
      --api-key K --vip-key V --batch-key B --stall-within 5
"""


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `conformance` on the `llmflow` parser.

    Args:
        subparsers: the `llmflow` command group.
    """
    p = subparsers.add_parser(
        "conformance",
        help="check llmflow's invariants from outside against any OpenAI-compatible gateway",
        description="Drive an OpenAI-compatible gateway from outside, against a fake vLLM this "
        "command starts, with floods, disconnects, stalled clients and a batch flood with VIP "
        "requests in it, and print a pass/fail table: every request ends exactly once, the "
        "claimed cap holds at the backend, the queue is bounded (fast refusals), Retry-After "
        "on every 429, no 500 for backpressure, a leaving or stalled client frees its backend "
        "request, VIP is served during a batch flood, nothing leaks.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("url", metavar="URL", help="the gateway's base URL (with or without /v1)")
    p.add_argument("--model", default=MODEL, help=f"model name to ask for (default {MODEL})")
    p.add_argument("--api-key", metavar="K", help="Bearer key of ordinary requests")
    p.add_argument("--max-concurrency", type=int, metavar="N",
                   help="the cap the gateway claims at the backend (unset: the row is n/a)")
    p.add_argument("--vip-key", metavar="K", help="a key of the gateway's top tier")
    p.add_argument("--batch-key", metavar="K",
                   help="a key of its lowest tier (with --vip-key: the VIP row)")
    p.add_argument("--flood", type=int, metavar="N",
                   help="requests per flood (default 8x the cap, at least 32; 64 without)")
    p.add_argument("--abort-within", type=float, default=1.0, metavar="S",
                   help="a client's disconnect must reach the backend within S (default 1)")
    p.add_argument("--refusal-within", type=float, default=2.0, metavar="S",
                   help="a refusal under the flood must come within S (default 2)")
    p.add_argument("--stall-within", type=float, default=60.0, metavar="S",
                   help="a stalled client's backend request must end within S (default 60)")
    p.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="the longest one request may take before it counts as broken")
    p.add_argument("--settle", type=float, default=10.0, metavar="S",
                   help="how long the backend may take to be idle after each phase (default 10)")
    p.add_argument("--backend-host", default="127.0.0.1",
                   help="address the suite's fake vLLM listens on (default 127.0.0.1)")
    p.add_argument("--backend-port", type=int, default=0, metavar="PORT",
                   help="its port (default: any free one, printed)")
    p.add_argument("--backend", metavar="URL",
                   help="use a standing suite backend (`llmflow conformance-backend`) at URL "
                   "instead of starting one")
    p.add_argument("--wait", type=float, default=120.0, metavar="S",
                   help="how long to wait for the gateway to serve from the backend")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=main)
    b = subparsers.add_parser(
        "conformance-backend",
        help="serve the conformance suite's fake vLLM on its own (for `conformance --backend`)",
        description="Serve the instrumented fake vLLM of `llmflow conformance` until stopped, "
        "for a gateway that must be pointed at a backend before the suite runs, or that runs "
        "on another machine; the suite reads its counters from GET /_conformance/state.",
    )
    b.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    b.add_argument("--port", type=int, default=9100, help="port to listen on (default 9100)")
    b.add_argument("--model", default=MODEL, help=f"served model name (default {MODEL})")
    b.set_defaults(func=serve_backend)


def _options(args: argparse.Namespace) -> Options:
    return Options(
        url=args.url, model=args.model, api_key=args.api_key,
        max_concurrency=args.max_concurrency, vip_key=args.vip_key, batch_key=args.batch_key,
        flood=args.flood, abort_within_s=args.abort_within,
        refusal_within_s=args.refusal_within, stall_within_s=args.stall_within,
        timeout_s=args.timeout, settle_s=args.settle, ready_within_s=args.wait,
    )


def main(args: argparse.Namespace) -> int:
    """`llmflow conformance`: returns 0 (all applicable passed), 1 (a failure) or 2."""
    if bool(args.vip_key) != bool(args.batch_key):
        print("error: give --vip-key and --batch-key together", file=sys.stderr)
        return 2
    options = _options(args)
    start = time.monotonic()

    def say(line: str) -> None:
        if not args.quiet:
            print(f"[{time.monotonic() - start:6.1f} s] {line}", file=sys.stderr, flush=True)

    try:
        if args.backend:
            rows = asyncio.run(_remote(options, args.backend, say))
        else:
            rows = _local(options, args, say)
    except SuiteError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(render(rows, f"llmflow conformance: {options.url}"))
    if args.json:
        write_json(rows, options.url, args.json)
    return 1 if failed(rows) else 0


def _local(options: Options, args: argparse.Namespace, say: Callable[[str], None]) -> list[Row]:
    backend = Backend(model=args.model)
    try:
        server = BackendServer(backend, args.backend_host, args.backend_port).start()
    except (OSError, RuntimeError) as exc:
        raise SuiteError(f"the backend could not listen: {exc}") from exc
    try:
        say(f"backend (fake vLLM, model {args.model!r}) at {server.url}: point the gateway at it")
        return asyncio.run(run(options, backend, say))
    finally:
        server.stop()


async def _remote(options: Options, url: str, say: Callable[[str], None]) -> list[Row]:
    backend = RemoteBackend(url)
    try:
        await backend.start()
    except httpx.HTTPError as exc:
        await backend.aclose()
        raise SuiteError(f"no suite backend at {url} (`llmflow conformance-backend`): "
                         f"{exc!r}") from exc
    try:
        say(f"backend (standing) at {url}")
        return await run(options, backend, say)
    finally:
        await backend.aclose()


def serve_backend(args: argparse.Namespace) -> int:
    """`llmflow conformance-backend`: serve the fake vLLM until interrupted."""
    try:
        server = BackendServer(Backend(model=args.model), args.host, args.port).start()
    except (OSError, RuntimeError) as exc:
        print(f"error: the backend could not listen: {exc}", file=sys.stderr)
        return 2
    print(f"conformance backend (fake vLLM, model {args.model!r}) at {server.url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()
