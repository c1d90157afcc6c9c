"""Backends in simulated time: each vLLM instance is one SimPy process, one timeout per step.

`Backend` wraps an `EngineCore`; `Cluster` builds the instances of a scenario and keeps the
cluster-wide gauges (`Gauges`): running, waiting, KV blocks, their peaks and exact time integrals,
updated on every change so peaks are never missed between samples.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llmflow.sim.costmodel import cost_model
from llmflow.sim.engine import EngineConfig, EngineCore, Seq
from llmflow.sim.profile import load_profile

if TYPE_CHECKING:
    from collections.abc import Callable, Generator

    import simpy

    from llmflow.sim.costmodel import StepCost
    from llmflow.sim.scenario import BackendGroup, Link

__all__ = ["Backend", "Cluster", "Gauges"]


class Gauges:
    """Cluster-wide counts with their peaks and time integrals."""

    __slots__ = (
        "area_running", "area_waiting", "blocks", "env", "last_t", "peak_kv", "peak_running",
        "peak_waiting", "running", "total_blocks", "used", "waiting",
    )

    def __init__(self, env: simpy.Environment, total_blocks: int):
        self.env = env
        self.running = self.waiting = self.used = 0
        self.peak_running = self.peak_waiting = 0
        self.peak_kv = 0.0
        self.area_running = self.area_waiting = 0.0
        self.last_t = 0.0
        self.total_blocks = total_blocks

    def shift(self, d_running: int, d_waiting: int, d_used: int, kv: float) -> None:
        """Apply changes of one backend at the current time."""
        now = self.env.now
        dt = now - self.last_t
        if dt:
            self.area_running += dt * self.running
            self.area_waiting += dt * self.waiting
            self.last_t = now
        self.running += d_running
        self.waiting += d_waiting
        self.used += d_used
        if self.running > self.peak_running:
            self.peak_running = self.running
        if self.waiting > self.peak_waiting:
            self.peak_waiting = self.waiting
        if kv > self.peak_kv:
            self.peak_kv = kv


class Backend:
    """One vLLM instance driven by SimPy.

    Args:
        env: the simulation environment.
        name: backend name (as in the llmflow config).
        core: the engine state.
        gauges: cluster gauges to keep up to date.
    """

    def __init__(self, env: simpy.Environment, name: str, core: EngineCore, gauges: Gauges):
        self.env, self.name, self.core, self.gauges = env, name, core, gauges
        self.gpus = 1
        self.role = "both"  # P/D disaggregation: "prefill", "decode" or "both" (`sim/disagg.py`)
        self.link: Link | None = None  # a decode instance's inbound KV link
        # Client-visible delay of every output (HTTP, IPC, detokenising): a measured profile's
        # `frontend_s`; 0 for the roofline presets, whose step times are the whole story.
        self.frontend_s = float(getattr(core.cost, "frontend_s", 0.0))
        self._wake: simpy.Event | None = None
        self._seen = (0, 0, 0)
        self.steps = 0
        self.budget_area = 0.0  # integral of the step token budget's share in use, over time
        env.process(self._run())

    def submit(self, seq: Seq) -> None:
        """Hand a request to vLLM (it queues in vLLM's waiting list).

        Raises:
            EngineError: the request is too long for `max_model_len`.
        """
        self.core.add(seq, self.env.now)
        self.kick()

    def kick(self) -> None:
        """Something changed outside a step (a request, KV freed or arrived): update the
        gauges and wake the engine if it sleeps."""
        self._sync()
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def abort(self, seq: Seq) -> bool:
        """Abort a request (client disconnect): frees its KV blocks at once."""
        done = self.core.abort(seq, self.env.now)
        if done:
            self._sync()
        return done

    def _sync(self) -> None:
        core = self.core
        r, w, u = len(core.running), core.num_waiting, core.used
        r0, w0, u0 = self._seen
        self._seen = (r, w, u)
        self.gauges.shift(r - r0, w - w0, u - u0, u / core.cap)

    def _run(self) -> Generator[simpy.Event, None, None]:
        env, core = self.env, self.core
        while True:
            dt = core.schedule(env.now)
            if dt is None:
                self._wake = env.event()
                yield self._wake
                self._wake = None
                continue
            self._sync()
            # Time-weighted use of the step's token budget: how compute-bound the engine is
            # (a prefill-bound engine fills it with slots and KV to spare).
            self.budget_area += dt * core.step_budget_used
            yield env.timeout(dt)
            now = env.now
            first, ended = core.complete(now)
            self.steps += 1
            self._sync()
            if self.frontend_s:
                late = env.timeout(self.frontend_s)
                late.callbacks.append(_later(self._notify, first, list(core.reached), ended))
            else:
                self._notify(first, core.reached, ended)

    def _notify(self, first: list[Seq], reached: list[Seq], ended: list[Seq]) -> None:
        now = self.env.now
        for seq in first:
            if seq.owner is not None:
                seq.owner.on_first_token(seq, now)
        for seq in reached:
            if seq.owner is not None:
                seq.owner.on_tokens_reached(seq, now)
        for seq in ended:
            if seq.owner is not None:
                seq.owner.on_finished(seq, now)


def _later(
    fn: Callable[[list[Seq], list[Seq], list[Seq]], None], *lists: list[Seq]
) -> Callable[[simpy.Event], None]:
    return lambda _ev: fn(*lists)


class Cluster:
    """The scenario's vLLM instances.

    Args:
        env: the simulation environment.
        groups: backend groups from the scenario.
        scheduling_policy: overrides each group's vLLM scheduling policy when not None.
        engine: vLLM flags overriding every group's (a policy's own launch flags).
    """

    def __init__(
        self, env: simpy.Environment, groups: list[BackendGroup], scheduling_policy: str | None,
        engine: dict[str, Any] | None = None,
    ):
        cores: list[tuple[str, BackendGroup, EngineCore]] = []
        for g in groups:
            flags = {**g.engine, **(engine or {})}
            if scheduling_policy is not None:
                flags["scheduling_policy"] = scheduling_policy
            if g.profile is not None:  # measured step cost; its engine limits under the flags
                profile = load_profile(g.profile)
                cost: StepCost = profile.cost()
                flags = {**profile.engine_flags(), **flags}
            else:
                gpu, model, knobs = g.specs()
                cost = cost_model(gpu, model, g.tp, knobs)
            config = EngineConfig(**flags)
            for i in range(g.count):
                name = g.name if g.count == 1 else f"{g.name}-{i}"
                cores.append((name, g, EngineCore(config, cost)))
        self.gauges = Gauges(env, sum(c.cap for _, _, c in cores))
        self.backends: list[Backend] = []
        for name, g, core in cores:
            b = Backend(env, name, core, self.gauges)
            b.gpus, b.role, b.link = g.tp, g.role, g.link
            self.backends.append(b)
        self.by_name = {b.name: b for b in self.backends}

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode run on separate pools."""
        return any(b.role != "both" for b in self.backends)

    @property
    def gpus(self) -> int:
        """GPUs over all instances."""
        return sum(b.gpus for b in self.backends)

    @property
    def preemptions(self) -> int:
        """Preemptions over all instances."""
        return sum(b.core.num_preemptions for b in self.backends)

    @property
    def steps(self) -> int:
        """Engine steps over all instances."""
        return sum(b.steps for b in self.backends)
