"""A pure-Python reference of routing between model pools, for property tests only.

It restates from the config alone what the core must respect when it picks a backend: a request
goes only to a healthy backend that serves its model (an alias standing for its target), never
past that backend's cap, and a `prefix` pool never sends a request to a backend loaded to
`routing.prefix_load_bound` (running / cap) while a candidate under the bound had a free slot.
It also says when a request must not be waiting: some healthy backend serving its model has a
free slot (pools never block one another). In a pool split into prefill and decode instances
(`role`), a request starts on a decode instance and a prefill instance at once, each under its
cap, and holds the prefill slot until its hop answers (`prefilled`) or it ends; it must not be
waiting while both kinds have a free slot. The configs it is used with keep every other rule
out of the way: one tier with the whole of each backend, no KV, SLA, breaker or stale metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RoutingReference:
    config: dict[str, Any]
    running: dict[str, int] = field(default_factory=dict)
    healthy: dict[str, bool] = field(default_factory=dict)
    placed: dict[int, str] = field(default_factory=dict)  # request id -> its backend
    waiting: dict[int, str] = field(default_factory=dict)  # request id -> its served model
    hops: dict[int, str] = field(default_factory=dict)  # request id -> its prefill instance

    def __post_init__(self) -> None:
        c = self.config
        self.cap = {b["name"]: b["gpus"] * c["max_concurrency_per_gpu"] for b in c["backends"]}
        self.serves = {b["name"]: set(b["models"]) for b in c["backends"]}
        self.role = {b["name"]: b.get("role", "both") for b in c["backends"]}
        self.running = dict.fromkeys(self.cap, 0)
        self.healthy = dict.fromkeys(self.cap, True)
        served = {m for models in self.serves.values() for m in models}
        self.target = {m: m for m in served} | dict(c.get("models", {}))
        routing = c.get("routing", {})
        self.bound = routing.get("prefix_load_bound", 0.9)
        default = routing.get("policy", "free_slots")
        self.policy = {m: routing.get("pools", {}).get(m, default) for m in served}

    def split(self, model: str) -> bool:
        """Whether `model`'s pool is split into prefill and decode instances."""
        return any(self.role[b] != "both" for b in self.cap if model in self.serves[b])

    def candidates(self, model: str, role: str | None = None) -> list[str]:
        """Backends a request for `model` may start on now (of `role`, if given)."""
        return [
            b
            for b in self.cap
            if self.healthy[b]
            and model in self.serves[b]
            and self.running[b] < self.cap[b]
            and role in (None, self.role[b])
        ]

    def can_start(self, model: str) -> bool:
        """A request for `model` could start now."""
        if self.split(model):
            return bool(self.candidates(model, "prefill") and self.candidates(model, "decode"))
        return bool(self.candidates(model))

    def can_serve(self, model: str) -> bool:
        """Some healthy backend (of each kind, in a split pool) serves `model`."""
        roles = ("prefill", "decode") if self.split(model) else ("both",)
        return all(
            any(self.healthy[b] and model in self.serves[b] and self.role[b] == r
                for b in self.cap)
            for r in roles
        )

    def past_bound(self, backend: str) -> bool:
        return self.running[backend] >= self.bound * self.cap[backend]

    def check_start(
        self, request_id: int, name: str, backend: str, prefill: str | None = None
    ) -> None:
        """A request for model `name` starts on `backend` (first on `prefill`, in a split pool):
        every rule, then count it."""
        model = self.target[name]
        split = self.split(model)
        assert (prefill is not None) == split, (model, backend, prefill)
        for b, role in ((backend, "decode" if split else "both"), (prefill, "prefill")):
            if b is None:
                continue
            assert model in self.serves[b], f"{b} does not serve {model}"
            assert self.role[b] == role, f"{b} is a {self.role[b]} backend, not {role}"
            assert self.healthy[b], f"{b} is down"
            assert self.running[b] < self.cap[b], f"{b} is at its cap"
        if self.policy[model] == "prefix" and self.past_bound(backend):
            role = "decode" if split else None
            under = [b for b in self.candidates(model, role) if not self.past_bound(b)]
            assert not under, f"{backend} is past the bound while {under} were under it"
        self.waiting.pop(request_id, None)
        self.placed[request_id] = backend
        self.running[backend] += 1
        if prefill is not None:
            self.hops[request_id] = prefill
            self.running[prefill] += 1

    def prefilled(self, request_id: int) -> None:
        """Its prefill hop answered: the prefill slot is free."""
        self.running[self.hops.pop(request_id)] -= 1

    def queue(self, request_id: int, name: str) -> None:
        self.waiting[request_id] = self.target[name]

    def end(self, request_id: int) -> None:
        self.waiting.pop(request_id, None)
        backend = self.placed.pop(request_id, None)
        if backend is not None:
            self.running[backend] -= 1
        if request_id in self.hops:
            self.prefilled(request_id)

    def stuck(self) -> list[int]:
        """Waiting requests that a backend serving their model could start now."""
        return [i for i, model in self.waiting.items() if self.can_start(model)]
