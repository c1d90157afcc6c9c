"""What checking a request costs: Python's `CompletionService.prepare` against the native
front's (`rust/src/front/prepare.rs`, through its PyO3 seam `FrontChecks.prepare`).

Both check the same typical 1 KiB chat body (a system and a user message, streamed, with
usage, a bound and sampling fields) with the same config; the Rust figure includes the PyO3
call and the result object, so the check alone costs less (`cargo bench --bench
front_prepare` prints it without Python). Each is timed by `timeit`, the best of `--repeat`
runs of `--number` calls.

Usage: `python -m benchmarks.front_prepare_bench [--number 20000] [--repeat 5]`.
"""

from __future__ import annotations

import argparse
import json
import timeit
from typing import Any, cast

from llmflow._core import FrontChecks
from llmflow.config import Limits
from llmflow.gateway.auth import Identity
from llmflow.gateway.serving import CompletionService
from llmflow.gateway.session import _FINGERPRINT_KEY

MODELS = {"llama": 8192}
BODY = {
    "model": "llama",
    "messages": [
        {"role": "system", "content": "You are a concise assistant. Answer in plain English."},
        {"role": "user", "content": "Summarise this text in two sentences: " + "lorem ipsum " * 60},
    ],
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_tokens": 256,
    "temperature": 0.7,
    "top_p": 0.9,
    "user": "user-1234",
}


def main() -> None:
    """Print ns per call of each, and their ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    raw = json.dumps(BODY).encode()
    service = CompletionService(cast("Any", None), MODELS, 4.0, True, Limits())
    checks = FrontChecks(
        MODELS, 4.0, True, 2048, 128, None, _FINGERPRINT_KEY,
        aliases={}, prefix_models=set(), block_size=16,
    )
    identity = Identity("t", "normal")
    assert checks.prepare("chat", raw) is not None
    runs = {
        "python": lambda: service.prepare("chat", identity, raw),
        "rust": lambda: checks.prepare("chat", raw),
    }
    ns = {}
    for name, call in runs.items():
        best = min(timeit.repeat(call, number=args.number, repeat=args.repeat))
        ns[name] = best / args.number * 1e9
    print(json.dumps({"body_bytes": len(raw), **{f"{k}_ns": round(v) for k, v in ns.items()},
                      "speedup": round(ns["python"] / ns["rust"], 1)}))


if __name__ == "__main__":
    main()
