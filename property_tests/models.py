"""A deliberately small pure-Python reference of the governor, for property tests only.

It keeps the facts the Rust core must agree with — who is queued or running where, the KV
ledger, the cap, the queue bound and the tier thresholds — without fairness order, estimates or
deadlines. It is never used by the product.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Req:
    tenant: str
    tier: int
    prompt: int
    generated: int = 0
    backend: str | None = None  # None while queued


@dataclass
class ReferenceGovernor:
    config: dict[str, Any]
    live: dict[int, Req] = field(default_factory=dict)
    kv_usage: dict[str, float] = field(default_factory=dict)
    healthy: dict[str, bool] = field(default_factory=dict)
    draining: bool = False

    def __post_init__(self) -> None:
        c = self.config
        self.tiers = {t["name"]: i for i, t in enumerate(c["tiers"])}
        self.tenant_tier = {t["name"]: self.tiers[t["tier"]] for t in c["tenants"]}
        self.caps = {b["name"]: b["gpus"] * c["max_concurrency_per_gpu"] for b in c["backends"]}
        self.healthy = dict.fromkeys(self.caps, True)

    def tier(self, i: int) -> dict[str, Any]:
        return self.config["tiers"][i]  # type: ignore[no-any-return]

    def running_on(self, backend: str, tier: int | None = None) -> int:
        return sum(
            r.backend == backend and (tier is None or r.tier == tier) for r in self.live.values()
        )

    @property
    def queued(self) -> int:
        return sum(r.backend is None for r in self.live.values())

    def queued_in(self, tier: int) -> int:
        return sum(r.backend is None and r.tier == tier for r in self.live.values())

    def blocks(self, req: Req) -> int:
        return math.ceil((req.prompt + req.generated) / self.config["block_size"])

    def ledger(self) -> int:
        return sum(self.blocks(r) for r in self.live.values() if r.backend is not None)

    def pressured(self, backend: str) -> bool:
        threshold = self.config["kv_pressure_threshold"]
        return threshold is not None and self.kv_usage.get(backend, 0.0) > threshold

    def placeable(self, tier: int) -> list[str]:
        """Backends where a request of `tier` may start now."""
        t = self.tier(tier)
        return [
            b
            for b, cap in self.caps.items()
            if self.healthy[b]
            and self.running_on(b) < cap
            and self.running_on(b, tier) < max(1, math.floor(cap * t["max_share"]))
            and (t["protected"] or not self.pressured(b))
        ]

    def victim(self, tenant: str) -> int | None:
        """The queued request `tenant` may push out when its tier's places are full."""
        weight = {t["name"]: t["weight"] for t in self.config["tenants"]}
        mine_tier = self.tenant_tier[tenant]
        lower = [r.tier for r in self.live.values() if r.backend is None and r.tier > mine_tier]
        tier = max(lower, default=mine_tier)
        queued: dict[str, list[int]] = {}
        for rid, r in self.live.items():
            if r.backend is None and r.tier == tier:
                queued.setdefault(r.tenant, []).append(rid)
        load = {t: len(ids) / weight[t] for t, ids in queued.items() if t != tenant}
        mine = (len(queued.get(tenant, [])) + 1) / weight[tenant] if tier == mine_tier else -1
        names = [t["name"] for t in self.config["tenants"]]
        heaviest = max(load, key=lambda t: (load[t], -names.index(t)), default=None)
        if heaviest is None or load[heaviest] <= mine:
            return None
        return max(queued[heaviest])

    def expected(self, tenant: str) -> tuple[str, str | None]:
        """(kind, reason) the core must decide for a new request of `tenant` now."""
        tier = self.tenant_tier[tenant]
        t = self.tier(tier)
        if self.draining:
            return "rejected", "draining"
        healthy = [b for b, ok in self.healthy.items() if ok]
        if not healthy:
            return "rejected", "no_healthy_backend"
        if not t["protected"] and all(self.pressured(b) for b in healthy):
            return "rejected", "kv_pressure"
        ahead = sum(self.queued_in(i) for i in range(tier + 1))
        if ahead == 0 and self.placeable(tier):
            return "admitted", None
        max_waiting = self.config["max_waiting"]
        if self.victim(tenant) is not None:
            full = self.queued >= min(max_waiting, math.floor(t["shed_at"] * max_waiting))
            return "queued", "displaces" if full else None
        if self.queued >= max_waiting:
            return "rejected", "queue_full"
        if self.queued >= math.floor(t["shed_at"] * max_waiting):
            return "rejected", "tier_shed"
        return "queued", None
