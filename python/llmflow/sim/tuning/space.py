"""The search space of `llmflow sim tune`: which config knobs it varies, and over what range.

`KNOBS` is the one table: a config path (as in the YAML file) and a distribution (`Int` or
`Float`, what optuna's `suggest_int`/`suggest_float` take) per line, so a new policy knob is one
more line. `tiers[*]` expands to every tier a workload tenant is in (a tier nobody sends to
changes nothing). A knob that `can_be_off` also tries null (the mechanism off); one that runs
`down_the_tiers` is sampled as a fraction of the tier above's value, which keeps `shed_at`
non-increasing down the tier list as the config validator requires.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmflow.config import load_settings

if TYPE_CHECKING:
    import optuna

    from llmflow.sim.scenario import Scenario

__all__ = ["KNOBS", "Float", "Int", "Knob", "Param", "Space", "base_config", "get_path", "set_path"]


@dataclass(frozen=True)
class Int:
    """Integers in `[low, high]` (optuna's `suggest_int`); kept free of optuna so that building
    the `llmflow` parser does not import it."""

    low: int
    high: int
    log: bool = False


@dataclass(frozen=True)
class Float:
    """Reals in `[low, high]` (optuna's `suggest_float`)."""

    low: float
    high: float
    log: bool = False


@dataclass(frozen=True)
class Knob:
    """One line of the search space."""

    path: str  # config path; `tiers[*]` stands for each tier the workload uses
    dist: Int | Float
    what: str
    can_be_off: bool = False  # null (the mechanism off) is one more choice
    down_the_tiers: bool = False  # value = sample x the tier above's value (never rises)


# fmt: off
KNOBS: tuple[Knob, ...] = (
    Knob("gate.max_concurrency_per_gpu", Int(2, 256, log=True),
         "the bound on requests running per GPU (vLLM's max_num_seqs is the ceiling)"),
    Knob("kv.fit_target", Float(0.5, 1.0),
         "share of the KV cache running requests may be expected to reach", can_be_off=True),
    Knob("kv.pressure_threshold", Float(0.6, 1.0),
         "KV usage above which unprotected tiers are shed", can_be_off=True),
    Knob("gate.headroom_quantile", Float(0.5, 0.9999),
         "chance a latency-tier arrival finds a slot in time (Erlang C headroom)",
         can_be_off=True),
    Knob("gate.headroom_wait_ms", Int(50, 5_000, log=True),
         "latency tiers' wait budget for a slot and for the prefill ahead, ms"),
    Knob("gate.tpot_target_ms", Int(10, 500, log=True),
         "per-token latency target the number running follows, ms (or off)", can_be_off=True),
    Knob("gate.queue.max_waiting", Int(16, 4096, log=True),
         "queue length: requests waiting in the gateway"),
    Knob("tiers[*].max_share", Float(0.05, 1.0),
         "share of each backend's slots the tier may hold"),
    Knob("tiers[*].shed_at", Float(0.05, 1.0),
         "queue fill above which the tier is refused (x the tier above's)", down_the_tiers=True),
    Knob("sla.ttft_ms", Int(250, 10_000, log=True),
         "TTFT SLA admission keeps, ms (or off)", can_be_off=True),
    Knob("preemption.cooldown_ms", Int(1_000, 120_000, log=True),
         "preemption breaker's cool-down, ms (or off)", can_be_off=True),
)
# fmt: on

_STEP = re.compile(r"^(?P<key>\w+)(?:\[(?P<sel>[^\]]+)\])?$")


def _child(node: Any, part: str) -> Any:
    m = _STEP.match(part)
    if m is None:
        raise KeyError(f"bad config path step {part!r}")
    node = node[m["key"]]
    if m["sel"] is not None:
        node = next((t for t in node if t["name"] == m["sel"]), None)
        if node is None:
            raise KeyError(f"no {m['key']} entry named {m['sel']!r}")
    return node


def get_path(data: dict[str, Any], path: str) -> Any:
    """The value at `path` (`gate.queue.max_waiting`, `tiers[batch].shed_at`) of a config."""
    node: Any = data
    for part in path.split("."):
        node = _child(node, part)
    return node


def set_path(data: dict[str, Any], path: str, value: Any) -> None:
    """Set the value at `path` of a config (the parents must exist)."""
    *parents, last = path.split(".")
    node: Any = data
    for part in parents:
        node = _child(node, part)
    node[last] = value


def base_config(sc: Scenario, policy: str) -> dict[str, Any]:
    """The full, validated config a scenario's gated policy starts from (no `backends`).

    Raises:
        KeyError: the scenario has no such policy, or it is not gated.
        ConfigFileError: its config does not validate.
    """
    from llmflow.sim.policies import policy_config

    if policy not in sc.policies:
        raise KeyError(f"unknown policy {policy!r}; the scenario defines {list(sc.policies)}")
    spec = sc.policies[policy]
    if spec.kind != "gated":
        gated = [n for n, p in sc.policies.items() if p.kind == "gated"]
        raise KeyError(
            f"policy {policy!r} is {spec.kind}: it has no knobs to tune; pick a gated one: {gated}"
        )
    data = load_settings(data=policy_config(policy, spec, sc)).model_dump(mode="json")
    del data["backends"]
    return data


@dataclass(frozen=True)
class Param:
    """A knob applied to one concrete path."""

    path: str  # `tiers[batch].shed_at`
    knob: Knob


class Space:
    """The knobs of `KNOBS` (or those selected) over one starting config.

    Args:
        base: the starting config (`base_config`).
        select: knob paths to vary (table paths such as `tiers[*].max_share`, or concrete ones
            such as `tiers[batch].max_share`); None: all.

    Raises:
        KeyError: a selected path is not in the table.
    """

    def __init__(self, base: dict[str, Any], select: list[str] | None = None):
        self.base = base
        used = {t["tier"] for t in base["tenants"]}
        tiers = [t["name"] for t in base["tiers"] if t["name"] in used]
        params = []
        for knob in KNOBS:
            paths = (
                [knob.path.replace("[*]", f"[{t}]") for t in tiers]
                if "[*]" in knob.path
                else [knob.path]
            )
            params += [Param(p, knob) for p in paths]
        if select:
            known = {p.path for p in params} | {p.knob.path for p in params}
            unknown = [s for s in select if s not in known]
            if unknown:
                raise KeyError(f"unknown knob {unknown}; knobs: {', '.join(sorted(known))}")
            params = [p for p in params if p.path in select or p.knob.path in select]
        self.params = params

    @property
    def paths(self) -> list[str]:
        """The concrete config paths varied."""
        return [p.path for p in self.params]

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        """A trial's config: the base with every knob drawn by the trial's sampler."""
        data = copy.deepcopy(self.base)
        for p in self.params:
            if p.knob.can_be_off and not trial.suggest_categorical(f"{p.path}:on", [True, False]):
                set_path(data, p.path, None)
                continue
            d = p.knob.dist
            if isinstance(d, Int):
                v: float = trial.suggest_int(p.path, d.low, d.high, log=d.log)
            else:
                v = trial.suggest_float(p.path, d.low, d.high, log=d.log)
            if p.knob.down_the_tiers:
                v = round(v * self._above(data, p.path), 4)
            elif isinstance(v, float):
                v = round(v, 4)
            set_path(data, p.path, v)
        _keep_order(data, self.params)
        return data

    def values(self, data: dict[str, Any]) -> dict[str, Any]:
        """The varied paths' values in a config."""
        return {p: get_path(data, p) for p in self.paths}

    def apply(self, values: dict[str, Any]) -> dict[str, Any]:
        """The config a trial ran, from its varied values (`values`): the starting config with
        those set, and a tier left alone lowered below a lowered one as `suggest` does."""
        data = copy.deepcopy(self.base)
        for path, value in values.items():
            set_path(data, path, value)
        _keep_order(data, self.params)
        return data

    def defaults(self) -> dict[str, Any]:
        """The trial parameters that give the starting config (clamped into each range), for
        `study.enqueue_trial`."""
        out: dict[str, Any] = {}
        for p in self.params:
            v = get_path(self.base, p.path)
            if p.knob.can_be_off:
                out[f"{p.path}:on"] = v is not None
                if v is None:
                    continue
            if p.knob.down_the_tiers:
                v = v / self._above(self.base, p.path)
            d = p.knob.dist
            v = min(max(v, d.low), d.high)
            out[p.path] = round(v) if isinstance(d, Int) else float(v)
        return out

    @staticmethod
    def _above(data: dict[str, Any], path: str) -> float:
        tier, field = _tier_field(path)
        names = [t["name"] for t in data["tiers"]]
        i = names.index(tier)
        return 1.0 if i == 0 else float(data["tiers"][i - 1][field])


def _tier_field(path: str) -> tuple[str, str]:
    m = re.match(r"^tiers\[(?P<tier>[^\]]+)\]\.(?P<field>\w+)$", path)
    if m is None:
        raise KeyError(f"{path!r}: down_the_tiers knobs must be tiers[*].<field>")
    return m["tier"], m["field"]


def _keep_order(data: dict[str, Any], params: list[Param]) -> None:
    """A tier the search left alone may now hold more than a lowered tier above it: bring it
    down to that tier's value."""
    for field in {_tier_field(p.path)[1] for p in params if p.knob.down_the_tiers}:
        tiers = data["tiers"]
        for i in range(1, len(tiers)):
            tiers[i][field] = min(tiers[i][field], tiers[i - 1][field])
