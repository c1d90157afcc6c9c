"""`llmflow config verify`: the runtime's state machine, run against the user's own config.

Hypothesis drives the runtime built from the user's config with random arrivals (of the
config's own tenants), tokens, failures, disconnects, slow readers, scrapes, timer firings and
the drain, and checks after every event what `machine.py` checks: no leak, no request that
never ends, no cap exceeded, no VIP refused while a less important tenant would get in, every
Retry-After sane, the timer right, replay exact, plus the user's own `max_running` invariants.
When a check breaks, Hypothesis shrinks the run to a minimal one and runs it once more; the
machine of that last run holds the shrunk event sequence, which is rendered as readable lines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hypothesis import HealthCheck, Phase, seed
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from hypothesis.reporting import with_reporter
from hypothesis.stateful import get_state_machine_test

from llmflow.verify.machine import machine_for

if TYPE_CHECKING:
    from llmflow.config import Settings
    from llmflow.verify.machine import RuntimeMachine

__all__ = ["Verdict", "render_step", "verify"]

_ARGS = {  # each runtime event's positional arguments, as the lines name them
    "arrive": ("id", "tenant", "prompt", "max_tokens", "stream"),
    "started": ("id",),
    "tokens": ("id", "n"),
    "done": ("id",),
    "failed": ("id", "status"),
    "client_gone": ("id",),
    "window_full": ("id",),
    "window_drained": ("id",),
    "scrape_ok": ("backend", "began_us"),
    "scrape_failed": ("backend",),
}
_KINDS = (  # the message's opening words -> the invariant, as the report names it
    ("leak", "leak: a request left a slot, a queue entry or KV blocks behind"),
    ("requests that never ended", "a request that never ends"),
    ("cap exceeded", "a backend's cap exceeded"),
    ("a VIP refused", "a VIP refused while a less important tenant would be admitted"),
    ("your invariant broken", "your own invariant (--max-running)"),
)


@dataclass
class Verdict:
    """What a verification found."""

    examples: int  # runs Hypothesis made (shrinking included)
    seconds: float
    invariant: str | None = None  # the broken invariant, None when every run passed
    message: str = ""
    steps: list[str] = field(default_factory=list)  # the shrunk sequence, one line per event

    @property
    def passed(self) -> bool:
        """True when no run broke an invariant."""
        return self.invariant is None


def verify(
    settings: Settings,
    examples: int = 200,
    seed_value: int = 0,
    steps: int = 100,
    max_running: dict[str, int] | None = None,
) -> Verdict:
    """Run the state machine on `settings` for `examples` runs of up to `steps` events each.

    Args:
        settings: the user's validated config.
        examples: how many runs to try (Hypothesis's `max_examples`).
        seed_value: the seed; the same seed explores the same runs.
        steps: events per run (Hypothesis's `stateful_step_count`).
        max_running: the user's own invariants: tenant -> most requests running at once.

    Returns:
        The verdict: passed, or the broken invariant and its shrunk event sequence.
    """
    runtime = settings.to_runtime()
    runtime["lifecycle"].pop("leases", None)  # one replica's policy: no store answers leases
    machine = machine_for(st.just(runtime), max_running)
    config = hypothesis_settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,  # a user's run leaves no example database behind
        print_blob=False,
        report_multiple_bugs=False,  # one broken invariant, shrunk, is the report
        suppress_health_check=list(HealthCheck),
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
    )
    test = seed(seed_value)(get_state_machine_test(machine, settings=config))
    runs = [0]
    original_init = machine.__init__

    def counting_init(self: RuntimeMachine) -> None:
        runs[0] += 1
        original_init(self)

    machine.__init__ = counting_init  # type: ignore[method-assign]
    started = time.monotonic()
    try:
        with with_reporter(lambda _text: None):  # the readable lines replace its report
            test()
    except AssertionError as exc:
        return _failed(machine.last, str(exc), runs[0], time.monotonic() - started)
    except Exception as exc:  # the runtime raised, or the checker has a bug: still a finding
        message = f"{type(exc).__name__}: {exc}"
        return _failed(machine.last, message, runs[0], time.monotonic() - started)
    return Verdict(runs[0], time.monotonic() - started)


def _failed(last: RuntimeMachine | None, message: str, runs: int, seconds: float) -> Verdict:
    first_line = message.strip().splitlines()[0] if message.strip() else "an assertion failed"
    first_line = first_line.split("; ")[0]  # the context that follows is the last line below
    invariant = next(
        (name for opening, name in _KINDS if first_line.startswith(opening)),
        "a rule of the runtime (see the message)",
    )
    lines = []
    if last is not None:
        for event, actions in zip(last.events, last.log, strict=False):
            lines.append(render_step(event, actions))
        if len(last.events) > len(last.log):  # the event whose check failed raised first
            lines.append(render_step(last.events[-1], ["(the check failed here)"]))
    return Verdict(runs, seconds, invariant, first_line, lines)


def render_step(event: tuple[str, tuple[Any, ...], dict[str, Any], int], actions: list[str]) -> str:
    """One event and what the runtime answered, as a line: `t=1200us arrive id=3 ... → ...`."""
    method, args, kwargs, now = event
    names = _ARGS.get(method, ())
    parts = [f"{names[i] if i < len(names) else f'arg{i}'}={v}" for i, v in enumerate(args)]
    parts += [f"{k}={v}" for k, v in kwargs.items() if v is not None]
    said = "; ".join(actions) if actions else "(no action)"
    return f"t={now}us {method} {' '.join(parts)} → {said}".replace("  ", " ")
