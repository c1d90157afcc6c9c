"""The flight recorder's command: `llmflow trace replay FILE`.

A trace (`llmflow sim run --trace`, or the gateway's) holds the runtime's config, then every
event with the actions it gave. Replaying feeds the events to a fresh runtime and checks that it
answers with the very same actions, bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

__all__ = ["add_commands"]


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `trace` (with `replay`) on the `llmflow` parser."""
    trace = subparsers.add_parser(
        "trace", help="work with runtime traces (the flight recorder)",
        description="Runtime traces are JSON lines: the config the runtime was built from, then "
        "every event it was fed with the actions it answered. `llmflow sim run --trace FILE` "
        "writes them.")
    trace_sub = trace.add_subparsers(title="trace commands", metavar="COMMAND")
    replay = trace_sub.add_parser(
        "replay", help="replay a trace and check every action",
        description="Feed FILE's events to a fresh runtime built from FILE's config and check "
        "that every action matches the recorded one, floats bit for bit. Exit status 0 when "
        "all match, 1 at the first mismatch (the message names the line), 2 when FILE cannot "
        "be read or is not a trace.")
    replay.add_argument("file", metavar="FILE", type=Path, help="JSONL trace file")
    replay.set_defaults(func=_replay)

    def _trace_help(_args: argparse.Namespace) -> int:
        trace.print_help()
        return 2

    trace.set_defaults(func=_trace_help)


def _replay(args: argparse.Namespace) -> int:
    from llmflow._core import InvalidArgumentError, TraceMismatchError, replay_trace

    try:
        text = args.file.read_text(encoding="utf-8")
        events, actions = replay_trace(text)
    except OSError as exc:
        print(f"error: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
        return 2
    except InvalidArgumentError as exc:
        print(f"error: {args.file}: {exc}", file=sys.stderr)
        return 2
    except TraceMismatchError as exc:
        print(f"{args.file}: mismatch: {exc}", file=sys.stderr)
        return 1
    print(f"replayed {events:,} events, {actions:,} actions: every action matches")
    return 0
