"""`llmflow calibrate`: measure a live vLLM backend and fit the simulator's step-cost profile.

`measure.calibrate` times the backend (prefill, decode and mixed steps) and fits
`llmflow.sim.profile.StepModel` in stages (`fit_step_model`); the profile (coefficients, engine
limits, residuals, raw samples) is written as YAML for `profile:` in a scenario backend.
`--refit` fits a stored profile again from the raw samples it holds. This module is the command:
its arguments, a progress bar, the summary it prints.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from llmflow.calibrate.measure import Calibration, Trace, calibrate, stream_request
from llmflow.sim.profile import Profile, ProfileError, load_profile, refit

if TYPE_CHECKING:
    import argparse

__all__ = ["Calibration", "Trace", "add_commands", "calibrate", "run", "stream_request"]


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `calibrate` on the `llmflow` parser.

    Args:
        subparsers: the `llmflow` command group.
    """
    p = subparsers.add_parser(
        "calibrate", help="measure a live vLLM backend and fit a simulator profile",
        description="Time a live backend (first-token latency vs prompt length, inter-token "
        "latency vs batch size and context, prompts joining a decoding batch), fit the "
        "simulator's step-cost model (each term from the probes that isolate it, non-negative "
        "least squares) and write it, with the raw measurements, to a YAML profile that a scenario "
        "backend can use as `profile: PATH`.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--backend", metavar="URL", help="vLLM base URL (no /v1)")
    source.add_argument("--refit", type=Path, metavar="PROFILE.yaml",
                        help="measure nothing: fit a profile again from the raw measurements it "
                        "holds (e.g. one written by an older llmflow)")
    p.add_argument("--out", required=True, type=Path, metavar="PROFILE.yaml", help="output file")
    p.add_argument("--model", help="served model name (default: the first one listed)")
    p.add_argument("--prompt-lengths", type=_ints, metavar="N,N,...",
                   help="prefill sweep prompt sizes (default 16,128,384,768,1152,1536)")
    p.add_argument("--repeats", type=int, default=3, help="requests per prompt size (default 3)")
    p.add_argument("--concurrency", type=_ints, metavar="B,B,...",
                   help="decode sweep batch sizes (default 1,2,4,8,16)")
    p.add_argument("--contexts", type=_ints, metavar="C,C,...",
                   help="decode sweep prompt sizes (default 32,640,1280)")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens per decode request")
    p.add_argument("--decode-repeats", type=int, default=2, help="runs of each decode batch")
    p.add_argument("--mixed-prompts", type=_ints, metavar="N,N,...",
                   help="prompt sizes that join a decoding batch (default 256,1024)")
    p.add_argument("--max-num-seqs", type=int, help="vLLM's --max-num-seqs, to record")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="vLLM's --max-num-batched-tokens, to record")
    p.add_argument("--seed", type=int,
                   help="seed of the random prompts (default: fresh; a seed repeated against "
                   "the same server hits its prefix cache)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def _calibration(args: argparse.Namespace) -> Calibration:
    cal = Calibration(args.backend.rstrip("/"), args.model, repeats=args.repeats,
                      decode_tokens=args.decode_tokens, decode_repeats=args.decode_repeats,
                      seed=args.seed)
    for name in ("prompt_lengths", "concurrency", "contexts", "mixed_prompts"):
        if getattr(args, name):
            setattr(cal, name, getattr(args, name))
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) is not None:
            cal.engine[name] = getattr(args, name)
    return cal


def _advance(bar: Any, n: int) -> None:
    bar.update(n)


def run(args: argparse.Namespace) -> int:
    """`llmflow calibrate`: measure (or refit), fit, write the profile, print a summary."""
    if args.refit is not None:
        return _refit(args.refit, args.out)
    from tqdm import tqdm

    cal = _calibration(args)
    with tqdm(total=cal.probes() + 1, desc="calibrate", unit="req", disable=args.no_progress,
              dynamic_ncols=True) as bar:
        try:
            profile = asyncio.run(calibrate(cal, lambda n: _advance(bar, n)))
        except (httpx.HTTPError, OSError, RuntimeError, ValueError) as exc:
            print(f"error: calibrating {cal.url} failed: {exc!r}", file=sys.stderr)
            return 1
    profile.dump(args.out)
    _summary(args.out, profile)
    return 0


def _refit(path: Path, out: Path) -> int:
    try:
        profile = refit(load_profile(path))
    except (ProfileError, ValueError) as exc:
        print(f"error: refitting {path}: {exc}", file=sys.stderr)
        return 1
    profile.dump(out)
    _summary(out, profile)
    return 0


def _summary(out: Path, profile: Profile) -> None:
    s, se = profile.step_s, profile.fit.get("rel_stderr", {})

    def err(term: str) -> str:  # the term's relative standard error, where the fit gives one
        return f" (+-{se[term]:.0%})" if se.get(term) is not None else ""

    print(f"{out}: {profile.model} at {profile.backend}")
    print(f"  step = {s.overhead * 1e3:.3f} ms{err('overhead')}"
          f" + {s.prefill_token * 1e6:.3f} us/prefill token{err('prefill_token')}"
          f" (+ {s.mixed_prefill * 1e6:.3f}{err('mixed_prefill')} among decodes)"
          f" + {s.prefill_attn * 1e12:.3f} ps/attn unit{err('prefill_attn')}"
          f" + {s.decode_seq * 1e6:.1f} us/decode{err('decode_seq')}"
          f" + {s.decode_ctx * 1e9:.2f} ns/context token{err('decode_ctx')}")
    print(f"  frontend {profile.frontend_s * 1e3:.2f} ms per request{err('frontend')}; fit median "
          f"error {profile.fit['median_abs_rel_error']:.1%}, max "
          f"{profile.fit['max_abs_rel_error']:.1%}")
