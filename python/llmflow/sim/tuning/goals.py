"""What a tuning run optimises and must respect: metrics read from a policy's report block.

A metric is a name over `llmflow sim run`'s report: a policy-wide one (`goodput`, `makespan`,
`lost`, ...) or a class's (`business.ttft_p99`, `batch.completed_frac`, ...). An objective is a
metric with its direction (the catalogue's); a constraint is `METRIC<=BOUND` or `METRIC>=BOUND`.
Over a trial's seeds an objective is the *mean* (the expected value, which a p99 over one seed
already makes noisy enough) and a constraint is the *worst* seed (a promise must hold on every
seed, so a lucky seed cannot make an infeasible config look feasible).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from llmflow.sim.scenario import Scenario

__all__ = [
    "CLASS_METRICS",
    "POLICY_METRICS",
    "Constraint",
    "GoalError",
    "Metric",
    "catalogue",
    "parse_constraint",
    "parse_metric",
    "slo_constraints",
]

_LOST = ("rejected", "timed_out", "truncated", "failed", "unfinished")  # not `cancelled`: the
# client left on its own (disconnect_after_*), which no policy can or should prevent


class GoalError(ValueError):
    """An objective or constraint names an unknown metric or is malformed."""


def _lost(c: dict[str, Any]) -> int:
    return sum(int(c[s]) for s in _LOST)


def _frac(done: int, arrived: int) -> float:
    return done / arrived if arrived else 1.0


def _all(p: dict[str, Any], key: str) -> int:
    return sum(int(c[key]) for c in p["classes"].values())


def _at(*keys: str) -> Callable[[dict[str, Any]], Any]:
    def read(block: dict[str, Any]) -> Any:
        for k in keys:
            block = block[k]
        return block

    return read


_Entry = tuple[str, str, str, "Callable[[dict[str, Any]], float | None]"]

# fmt: off
# name: (direction, unit, what it is, reader of a policy's report block)
POLICY_METRICS: dict[str, _Entry] = {
    "goodput": ("maximize", "req/s", "requests completed within their class SLO per second of "
                "the arrival window (duration_s)", _at("goodput_rps")),
    "makespan": ("minimize", "s", "simulated time until the last request ended (sim s)",
                 _at("sim_s")),
    "lost": ("minimize", "requests", "requests rejected, timed out, truncated, failed or "
             "unfinished, all classes", lambda p: sum(_lost(c) for c in p["classes"].values())),
    "completed_frac": ("maximize", "", "completed / arrived, all classes",
                       lambda p: _frac(_all(p, "completed"), _all(p, "arrived"))),
    "preemptions": ("minimize", "", "vLLM preemptions", _at("preemptions")),
    "peak_kv": ("minimize", "", "peak KV cache usage (0-1)", _at("peak_kv_usage")),
    "peak_queue": ("minimize", "requests", "peak gateway queue", _at("peak_queue")),
}

# name: (direction, unit, what it is, reader of a class's report block)
CLASS_METRICS: dict[str, _Entry] = {
    **{f"ttft_p{q}": ("minimize", "s", f"p{q} time to first token, user-perceived",
                      _at("ttft_s", f"p{q}")) for q in (50, 90, 99)},
    **{f"e2e_p{q}": ("minimize", "s", f"p{q} end-to-end time", _at("e2e_s", f"p{q}"))
       for q in (50, 90, 99)},
    **{f"wait_p{q}": ("minimize", "s", f"p{q} gateway queue wait", _at("queue_wait_s", f"p{q}"))
       for q in (50, 99)},
    "completed_frac": ("maximize", "", "completed / arrived",
                       lambda c: _frac(c["completed"], c["arrived"])),
    "lost": ("minimize", "requests", "rejected + timed_out + truncated + failed + unfinished",
             _lost),
    "completed": ("maximize", "requests", "requests completed", _at("completed")),
    **{s: ("minimize", "requests", f"requests that ended {s}", _at(s))
       for s in (*_LOST, "cancelled")},
    "retries_429": ("minimize", "", "429 answers the class's clients got and retried",
                    _at("retries_429")),
}
# fmt: on


@dataclass(frozen=True)
class Metric:
    """One metric of a policy's run, as named on the command line."""

    name: str  # `goodput`, `business.ttft_p99`
    direction: str  # "maximize" or "minimize"
    unit: str
    what: str
    cls: str | None  # the workload class, for class metrics
    key: str  # the catalogue name
    missing: float  # value when the report has none (a percentile without samples): the worst

    def read(self, policy: dict[str, Any]) -> float:
        """This metric from a policy's report block (`report["policies"][name]`)."""
        if self.cls is None:
            value = POLICY_METRICS[self.key][3](policy)
        else:
            value = CLASS_METRICS[self.key][3](policy["classes"][self.cls])
        return self.missing if value is None else float(value)

    def worst(self, values: Sequence[float]) -> float:
        """The worst of several seeds' values."""
        return max(values) if self.direction == "minimize" else min(values)


@dataclass(frozen=True)
class Constraint:
    """`metric <= bound` or `metric >= bound`, judged on the worst seed."""

    metric: Metric
    op: str  # "<=" or ">="
    bound: float

    @property
    def text(self) -> str:
        """As the user wrote it (normalised)."""
        return f"{self.metric.name}{self.op}{self.bound:g}"

    def worst(self, values: Sequence[float]) -> float:
        """The seed that comes closest to breaking it."""
        return max(values) if self.op == "<=" else min(values)

    def violation(self, values: Sequence[float]) -> float:
        """Optuna's constraint value: <= 0 when met, else how far off, relative to the bound."""
        scale = abs(self.bound) or 1.0
        w = self.worst(values)
        return (w - self.bound) / scale if self.op == "<=" else (self.bound - w) / scale


def catalogue(sc: Scenario) -> str:
    """Every metric name the scenario offers, for `--help` and error messages."""
    classes = ", ".join(wc.name for wc in sc.workload)
    return (
        f"metrics: {', '.join(POLICY_METRICS)}; per class (<class>.<metric>, classes: "
        f"{classes}): {', '.join(CLASS_METRICS)}"
    )


def parse_metric(name: str, sc: Scenario) -> Metric:
    """Resolve a metric name against the scenario's classes.

    Raises:
        GoalError: the name is not a known metric, with the list of those that are.
    """
    name = name.strip()
    missing = sc.horizon_s  # no sample at all is as bad as waiting until the run stops
    if name in POLICY_METRICS:
        direction, unit, what, _ = POLICY_METRICS[name]
        return Metric(name, direction, unit, what, None, name, missing)
    cls, _, key = name.rpartition(".")
    classes = [wc.name for wc in sc.workload]
    if cls and cls not in classes:
        raise GoalError(
            f"unknown class {cls!r} in metric {name!r}; the scenario's classes are "
            f"{', '.join(classes)}"
        )
    if cls and key in CLASS_METRICS:
        direction, unit, what, _ = CLASS_METRICS[key]
        return Metric(name, direction, unit, what, cls, key, missing)
    hint = f"; did you mean {classes[0]}.{name}?" if not cls and name in CLASS_METRICS else ""
    raise GoalError(f"unknown metric {name!r}{hint}; {catalogue(sc)}")


_CONSTRAINT = re.compile(
    r"^\s*(?P<metric>[^<>=!\s]+)\s*(?P<op><=|>=|<|>|==|=)\s*"
    r"(?P<bound>\S+)\s*$"
)


def parse_constraint(text: str, sc: Scenario) -> Constraint:
    """Parse `METRIC<=BOUND` or `METRIC>=BOUND` (times in seconds).

    Raises:
        GoalError: it is malformed, uses another operator, or names an unknown metric.
    """
    m = _CONSTRAINT.match(text)
    if m is None:
        raise GoalError(
            f"constraint {text!r} is not METRIC<=NUMBER or METRIC>=NUMBER "
            "(e.g. 'business.ttft_p99<=1.5', times in seconds)"
        )
    if m["op"] not in ("<=", ">="):
        raise GoalError(
            f"constraint {text!r}: use <= or >= (a bound that may be reached), not {m['op']}"
        )
    try:
        bound = float(m["bound"])
    except ValueError:
        raise GoalError(
            f"constraint {text!r}: the bound {m['bound']!r} is not a number "
            "(times are in seconds: 1.5, not 1.5s)"
        ) from None
    return Constraint(parse_metric(m["metric"], sc), m["op"], bound)


def slo_constraints(sc: Scenario) -> list[str]:
    """The SLOs the scenario declares, as constraint texts."""
    out = []
    for wc in sc.workload:
        if wc.slo is None:
            continue
        if wc.slo.ttft_p99_s is not None:
            out.append(f"{wc.name}.ttft_p99<={wc.slo.ttft_p99_s:g}")
        if wc.slo.e2e_p99_s is not None:
            out.append(f"{wc.name}.e2e_p99<={wc.slo.e2e_p99_s:g}")
        if wc.slo.min_completed_frac is not None:
            out.append(f"{wc.name}.completed_frac>={wc.slo.min_completed_frac:g}")
    return out
