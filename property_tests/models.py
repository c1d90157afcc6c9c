"""A pure-Python reference of the governor, for property tests only.

It restates, from the config alone, the rules the Rust core must follow: who may start where (the
cap, halved by stale metrics and, for unprotected tiers, per breaker level; `max_share`; KV
pressure and KV fit for unprotected tiers), what `submit` decides (tier limits and the room a
tier drains within the queue's wait limit, displacement, the TTFT SLA estimate while a tier's
arrivals outpace its drain, the breaker), the fair order inside a tier (the Virtual Token Counter,
with the requests past their TTFT SLA in an overload behind the rest),
the KV ledger and every request's deadlines. It is never used by the product, and it dispatches
nothing itself: the state machine applies the core's admissions to it after checking each one.
The placement and deadline rules it shares with the runtime's reference (`llmflow.verify.model`)
are `llmflow.verify.rules`'s, written once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from llmflow.verify import rules
from llmflow.verify.rules import MAX_SHED_LEVEL, us

EXPIRY_REASONS = ("queue_timeout", "first_token_timeout", "deadline")  # same-instant order
KV_COST_TOKENS = 1024.0  # context tokens per extra unit of output cost (times kv_weight)
EWMA_ALPHA = 0.2  # weight of a new prefill-throughput, hold-time or service-time sample
ARRIVAL_WINDOW_S = 60.0  # time constant of a tier's arrival rate
PRIOR_HOLD_S = 10.0  # a tier's hold time, and the mean service time, until one completes
PREFILL_SAMPLE_US = 500_000  # shortest interval of a prefill-throughput sample


@dataclass
class Req:
    tenant: str
    tier: int
    prompt: int
    generated: int = 0
    backend: str | None = None  # None while queued
    submitted: int = 0
    started: int = 0  # µs it got its slot (meaningful once `backend` is set)
    first_token: bool = False
    prefill_alone: bool = False  # nothing else was in prefill on its backend when it started
    lapses: bool = False  # queued, and will be looked at once its TTFT SLA has passed
    late: bool = False  # it was past its SLA while its tier was overloaded: behind the rest


@dataclass
class Backend:
    cap: int
    kv_blocks: int  # 0: capacity unknown, no fit check
    prefill_tps: float
    prefilled: int = 0  # prompt tokens whose first token came since `sample_at`
    sample_at: int | None = None  # µs the current throughput interval began
    pending_at_sample: int = 0  # prompt tokens in prefill when it began
    healthy: bool = True
    seen_at: int | None = None  # µs of the last scrape
    kv_usage: float | None = None  # what the last scrape reported
    preemptions: int | None = None  # the last scrape's counter


@dataclass
class Tenant:
    tier: int
    weight: float
    counter: float = 0.0  # VTC: service / weight, lifted when it becomes backlogged
    service: float = 0.0
    queue: list[int] = field(default_factory=list)  # queued ids, oldest first


@dataclass
class ReferenceGovernor:
    config: dict[str, Any]
    live: dict[int, Req] = field(default_factory=dict)
    shed_level: int = 0
    breaker_until: int = 0
    draining: bool = False

    def __post_init__(self) -> None:
        c = self.config
        tiers = {t["name"]: i for i, t in enumerate(c["tiers"])}
        self.tenants = {t["name"]: Tenant(tiers[t["tier"]], t["weight"]) for t in c["tenants"]}
        self.backends = {
            b["name"]: Backend(
                b["gpus"] * c["max_concurrency_per_gpu"],
                b["kv_blocks"],
                c["prefill_tokens_per_s"],
            )
            for b in c["backends"]
        }
        self.last_served = [0.0] * len(tiers)  # counter of the tenant a tier served last
        # completed output, smoothed: per tenant, per tier, over all (a tenant with no history
        # is expected to look like its tier, else like everyone)
        self.mean_output: dict[str, float] = {}
        self.tier_output: dict[int, float] = {}
        self.all_output: list[float] = []
        # per tier: arrivals decaying over a minute (and as of when), completed hold times
        self.arrivals = [(0.0, 0)] * len(tiers)
        self.hold: dict[int, float] = {}
        self.service: float | None = None  # completed requests' time on a slot, smoothed

    def expected_output(self, tenant: str, max_tokens: int) -> int:
        tier = self.tenants[tenant].tier
        for mean in (self.mean_output.get(tenant), self.tier_output.get(tier), *self.all_output):
            if mean is not None:
                return min(math.ceil(mean), max_tokens)
        return max_tokens

    # ---- readings --------------------------------------------------------------------------

    def tier(self, i: int) -> dict[str, Any]:
        return self.config["tiers"][i]  # type: ignore[no-any-return]

    def blocks(self, tokens: int) -> int:
        return rules.blocks(tokens, self.config["block_size"])

    def running(self, backend: str | None = None, tier: int | None = None) -> list[Req]:
        return [
            r
            for r in self.live.values()
            if r.backend is not None and backend in (None, r.backend) and tier in (None, r.tier)
        ]

    def queued(self, max_tier: int | None = None) -> list[int]:
        return [
            rid
            for rid, r in self.live.items()
            if r.backend is None and (max_tier is None or r.tier <= max_tier)
        ]

    def ledger(self, backend: str | None = None) -> int:
        return sum(self.blocks(r.prompt + r.generated) for r in self.running(backend))

    def stale(self, name: str, now: int) -> bool:
        return rules.stale(now, self.backends[name].seen_at, self.config["stale_after_ms"])

    def usage(self, name: str, now: int) -> float:
        b = self.backends[name]
        return rules.kv_usage(b.kv_usage, self.ledger(name), b.kv_blocks, self.stale(name, now))

    def pressured(self, name: str, now: int) -> bool:
        threshold = self.config["kv_pressure_threshold"]
        return threshold is not None and self.usage(name, now) > threshold

    def limits(self, name: str, tier: int, now: int) -> tuple[int, int]:
        """(slots the tier may see in all, slots of its own) on a backend now."""
        cap = self.backends[name].cap
        return rules.slot_limits(cap, self.tier(tier), self.stale(name, now), self.shed_level)

    def fits(self, name: str, prompt: int, now: int) -> bool:
        b, busy = self.backends[name], bool(self.running(name))
        usage = self.usage(name, now)
        return rules.kv_fits(self.blocks(prompt), b.kv_blocks, busy, usage, self.ledger(name))

    def placeable(self, tier: int, prompt: int = 0, now: int = 0) -> list[str]:
        """Backends a request of `tier` may start on now, most headroom first."""
        protected, room = self.tier(tier)["protected"], {}
        for name, b in self.backends.items():
            total, share = self.limits(name, tier, now)
            running = len(self.running(name))
            if (
                b.healthy
                and running < total
                and len(self.running(name, tier)) < share
                and (protected or not self.pressured(name, now))
                and (protected or self.fits(name, prompt, now))
            ):
                room[name] = total - running
        return sorted(room, key=lambda name: -room[name])  # ties: config order

    def line(self, t: Tenant) -> list[int]:
        """A tenant's queued requests in the order they start: those that can still be on
        time, oldest first, then the late ones, oldest first."""
        return [r for r in t.queue if not self.live[r].late] + [
            r for r in t.queue if self.live[r].late
        ]

    def head(self, tier: int) -> int | None:
        """The queued request a tier starts next: the first in line of the tenant with the
        smallest counter, among tenants whose first is on time, else among the rest."""
        backlogged = [
            (self.live[first].late, t.counter, i, first)
            for i, t in enumerate(self.tenants.values())
            if t.tier == tier and t.queue
            for first in self.line(t)[:1]
        ]
        return min(backlogged)[3] if backlogged else None

    def ahead(self, tier: int) -> int:
        """Queued requests a new one of the tier waits behind: every one of a more important
        tier, and its own tier's that are not late."""
        return sum(
            1 for r in self.live.values()
            if r.backend is None and (r.tier < tier or (r.tier == tier and not r.late))
        )

    def lapse(self, now: int) -> None:
        """What `submit` and `dispatch` do first: each queued request whose TTFT SLA passed is
        looked at once, and goes behind the rest of its tier if the tier is overwhelmed then."""
        sla = us(self.config["ttft_sla_ms"])
        if sla is None:
            return
        for r in self.live.values():
            if r.lapses and now >= r.submitted + sla:
                r.lapses = False
                r.late = self.overwhelmed(r.tier, now)

    def stuck(self, now: int) -> list[tuple[int, str]]:
        """Queued requests that could start now: each tier's head, where it has a place."""
        out = []
        for tier in range(len(self.config["tiers"])):
            rid = self.head(tier)
            where = [] if rid is None else self.placeable(tier, self.live[rid].prompt, now)
            if where:
                out.append((rid, where[0]))
        return out

    def priority(self, tier: int, tokens: int) -> int:
        return tier * 1000 + int(min(self.blocks(tokens) * self.config["kv_weight"] / 8, 999))

    # ---- what submit decides ---------------------------------------------------------------

    def victim(self, tenant: str) -> int | None:
        """The queued request `tenant` may push out when its tier's places are full."""
        mine = self.tenants[tenant].tier
        load = {n: len(t.queue) / t.weight for n, t in self.tenants.items() if t.queue}
        lower = [self.tenants[n].tier for n in load if self.tenants[n].tier > mine]
        tier = max(lower, default=mine)
        names = [n for n in load if self.tenants[n].tier == tier and n != tenant]
        if not names:
            return None
        heaviest = max(names, key=lambda n: (load[n], -list(self.tenants).index(n)))
        own = (len(self.tenants[tenant].queue) + 1) / self.tenants[tenant].weight
        if tier == mine and load[heaviest] <= own:
            return None
        return self.line(self.tenants[heaviest])[-1]

    def decayed(self, tier: int, now: int) -> float:
        """The tier's arrivals, each weighing less by a factor e per minute since."""
        count, at = self.arrivals[tier]
        return count * math.exp(-(max(now - at, 0) / 1e6) / ARRIVAL_WINDOW_S)

    def rate(self, tier: int, now: int) -> float:
        """The tier's arrivals per second over the last minute."""
        return self.decayed(tier, now) / ARRIVAL_WINDOW_S

    def drain(self, tier: int) -> float:
        """Requests of the tier that leave per second: its running ones on healthy backends over
        its hold time; with none running, every healthy slot over the mean service time."""
        healthy = [n for n, b in self.backends.items() if b.healthy]
        running = sum(len(self.running(n, tier)) for n in healthy)
        if running:
            return running / self.hold.get(tier, PRIOR_HOLD_S)
        slots = max(sum(self.backends[n].cap for n in healthy), 1)
        return slots / (self.service if self.service is not None else PRIOR_HOLD_S)

    def sustained(self, tier: int, now: int) -> bool:
        """Arrivals outpace the drain: only then does the TTFT SLA refuse."""
        return self.rate(tier, now) > self.drain(tier)

    def overwhelmed(self, tier: int, now: int) -> bool:
        """A minute's excess of arrivals over the drain is more than the queue's wait limit
        drains: only then do requests past the SLA go behind the rest."""
        wait_s = (self.config["queue_timeout_ms"] or 0.0) / 1000.0
        return self.rate(tier, now) > self.drain(tier) * (1.0 + wait_s / ARRIVAL_WINDOW_S)

    def room(self, tier: int) -> tuple[int, int]:
        """(the tier's waiting places, the queue's) for a newcomer of the tier: the configured
        ones, or what a latency tier at or below it drains within the queue's wait limit (once
        one of its requests completed: the prior hold is a guess)."""
        c, t = self.config, self.tier(tier)
        most, limit = c["max_waiting"], c["queue_timeout_ms"]
        if not c.get("queue_follows_drain", True):
            limit = None  # max_waiting is a hard bound
        latency = [
            u
            for u in range(tier, len(c["tiers"]))
            if not self.tier(u).get("best_effort") and u in self.hold
        ]
        drained = 0
        if limit is not None:
            drained = max((int(self.drain(u) * limit / 1000.0) for u in latency), default=0)
        return max(math.floor(t["shed_at"] * most), drained), max(most, drained)

    def late(self, tenant: str, prompt: int) -> bool:
        """The prefill ahead of a new request (fair share of its tier) overshoots the SLA."""
        sla = self.config["ttft_sla_ms"]
        if sla is None:
            return False
        me = self.tenants[tenant]

        def waiting(t: Tenant) -> int:
            return sum(self.live[rid].prompt for rid in t.queue if not self.live[rid].late)

        higher = sum(
            self.live[rid].prompt
            for t in self.tenants.values() if t.tier < me.tier
            for rid in t.queue
        )
        own = waiting(me)
        served = (own + prompt) / me.weight
        others = sum(
            min(waiting(t), int(served * t.weight))
            for t in self.tenants.values()
            if t.tier == me.tier and t is not me
        )
        healthy = [name for name, b in self.backends.items() if b.healthy]
        pending = sum(r.prompt for n in healthy for r in self.running(n) if not r.first_token)
        tps = sum(self.backends[n].prefill_tps for n in healthy)
        return (higher + own + others + pending) / tps > sla / 1000.0

    def decide(self, tenant: str, prompt: int, max_tokens: int, now: int) -> tuple[str, Any]:
        """("admitted", backend), ("queued", victim or None) or ("rejected", reason)."""
        tier = self.tenants[tenant].tier
        t, c = self.tier(tier), self.config
        if self.draining:
            return "rejected", "draining"
        healthy = [name for name, b in self.backends.items() if b.healthy]
        if not healthy:
            return "rejected", "no_healthy_backend"
        unprotected = not t["protected"]
        lowest = min(self.usage(name, now) for name in healthy)
        threshold = c["kv_pressure_threshold"]
        if unprotected and threshold is not None and lowest > threshold:
            return "rejected", "kv_pressure"
        late = unprotected and self.late(tenant, prompt) and self.sustained(tier, now)
        where = self.placeable(tier, prompt, now)
        if not self.ahead(tier) and where:
            return ("rejected", "ttft_sla") if late else ("admitted", where[0])
        queued, (tier_room, most) = len(self.queued()), self.room(tier)
        victim = None
        if queued >= min(tier_room, most):
            victim = self.victim(tenant)
            if victim is None:
                return "rejected", "queue_full" if queued >= most else "tier_shed"
        breaker_limit = math.floor(t["shed_at"] * 0.5**self.shed_level * c["max_waiting"])
        if unprotected and self.shed_level and queued >= breaker_limit:
            return "rejected", "preemption_breaker"
        return ("rejected", "ttft_sla") if late else ("queued", victim)

    # ---- events ----------------------------------------------------------------------------

    def add(self, rid: int, tenant: str, prompt: int, now: int, backend: str | None) -> None:
        """A request `submit` let in: started on `backend`, or queued (None)."""
        t = self.tenants[tenant]
        self.live[rid] = Req(tenant, t.tier, prompt, submitted=now)
        if backend is not None:
            self.start(rid, backend, now)
            return
        self.arrive(tenant)
        t.queue.append(rid)
        c = self.config
        yields = c.get("late_yields", True) and not self.tier(t.tier).get("best_effort")
        self.live[rid].lapses = yields and c["ttft_sla_ms"] is not None

    def count(self, tenant: str, now: int) -> None:
        """Every submit counts toward its tier's arrival rate, refused or not."""
        tier = self.tenants[tenant].tier
        self.arrivals[tier] = (self.decayed(tier, now) + 1.0, max(self.arrivals[tier][1], now))

    def arrive(self, tenant: str) -> None:
        """VTC lift at every arrival of a tenant with nothing waiting: idling earns no credit."""
        t = self.tenants[tenant]
        if not t.queue:
            floor = [u.counter for u in self.tenants.values() if u.tier == t.tier and u.queue]
            t.counter = max(t.counter, min(floor, default=self.last_served[t.tier]))

    def start(self, rid: int, backend: str, now: int) -> None:
        """Give a request (new, or a queued tier head) its slot and charge its prompt."""
        req, t = self.live[rid], self.tenants[self.live[rid].tenant]
        if rid in t.queue:
            t.queue.remove(rid)
        req.lapses = req.late = False
        self.last_served[t.tier] = t.counter
        # the core's own test: no prompt tokens in prefill there (a 0-token prompt adds none)
        req.prefill_alone = not sum(r.prompt for r in self.running(backend) if not r.first_token)
        req.backend, req.started = backend, now
        self.charge(req.tenant, self.config["input_token_weight"] * req.prompt)

    def charge(self, tenant: str, cost: float) -> None:
        t = self.tenants[tenant]
        t.service += cost
        t.counter += cost / t.weight

    def on_first_token(self, rid: int, now: int) -> None:
        req = self.live.get(rid)
        if req is None or req.backend is None or req.first_token:
            return
        b, elapsed = self.backends[req.backend], now - req.started
        b.prefilled += req.prompt
        if req.prefill_alone and elapsed and req.prompt:  # a lower bound: may only raise it
            floor = req.prompt / (elapsed / 1e6)
            if floor > b.prefill_tps:
                b.prefill_tps += EWMA_ALPHA * (min(floor, b.prefill_tps * 100.0) - b.prefill_tps)
        self.sample_prefill(req.backend, now)
        req.first_token = True

    def sample_prefill(self, name: str, now: int) -> None:
        """A throughput sample per interval of >= 500 ms that began with prefill pending."""
        b = self.backends[name]
        if b.sample_at is not None:
            elapsed = now - b.sample_at
            if elapsed < PREFILL_SAMPLE_US:
                return
            if b.pending_at_sample and b.prefilled:
                sample = b.prefilled / (elapsed / 1e6)
                sample = min(max(sample, b.prefill_tps / 100.0), b.prefill_tps * 100.0)
                b.prefill_tps += EWMA_ALPHA * (sample - b.prefill_tps)
        b.prefilled, b.sample_at = 0, now
        b.pending_at_sample = sum(r.prompt for r in self.running(name) if not r.first_token)

    def on_tokens(self, rid: int, n: int, now: int) -> None:
        req = self.live.get(rid)
        if n == 0 or req is None or req.backend is None:
            return
        self.on_first_token(rid, now)
        req.generated += n
        c = self.config
        per_token = c["output_token_weight"] + c["kv_weight"] * (req.prompt + req.generated) / (
            KV_COST_TOKENS
        )
        self.charge(req.tenant, per_token * n)

    def finish(self, rid: int, outcome: str | None = None, now: int = 0) -> bool:
        req = self.live.pop(rid, None)
        if req is not None and req.backend is None:
            self.tenants[req.tenant].queue.remove(rid)
        if req is not None and req.backend is not None and outcome == "completed":
            self.record_hold(req, now)
            g = float(req.generated)

            def fold(mean: float | None) -> float:
                return g if mean is None else mean + EWMA_ALPHA * (g - mean)

            self.mean_output[req.tenant] = fold(self.mean_output.get(req.tenant))
            self.tier_output[req.tier] = fold(self.tier_output.get(req.tier))
            self.all_output = [fold(self.all_output[0] if self.all_output else None)]
        return req is not None

    def record_hold(self, req: Req, now: int) -> None:
        """A completed request's time on its slot: its tier's hold time, the service time."""
        took = max(now - req.started, 0) / 1e6
        sample, held, mean = max(took, 1e-3), self.hold.get(req.tier), self.service
        self.hold[req.tier] = sample if held is None else held + EWMA_ALPHA * (sample - held)
        self.service = max(took if mean is None else mean + EWMA_ALPHA * (took - mean), 1e-3)

    def deadlines(self, req: Req) -> list[tuple[int, int]]:
        """(µs, index in EXPIRY_REASONS) of each deadline a request has now."""
        queued, started = req.backend is None, None if req.backend is None else req.started
        return rules.deadlines(
            self.config, req.submitted, queued, started, req.first_token, req.prompt
        )

    def next_deadline(self) -> int | None:
        return min((at for r in self.live.values() for at, _ in self.deadlines(r)), default=None)

    def expire(self, now: int) -> list[tuple[int, str, bool, str | None]]:
        """End each request past a deadline: (id, reason, was running, backend), due first."""
        due = []
        for rid, req in self.live.items():
            passed = [d for d in self.deadlines(req) if d[0] <= now]
            if passed:
                at, reason = min(passed)
                due.append((at, rid, reason, req.backend))
        due.sort()
        for _, rid, _, _ in due:
            self.finish(rid)
        return [(rid, EXPIRY_REASONS[r], b is not None, b) for _, rid, r, b in due]

    def tick(self, now: int) -> None:
        """The breaker cools down one level per elapsed cool-down."""
        cooldown = self.config["preemption_cooldown_ms"]
        level, until = rules.cooled(self.shed_level, self.breaker_until, now, cooldown)
        self.shed_level, self.breaker_until = level, until

    def observe(
        self, name: str, now: int, usage: float | None, preemptions: int | None, kv: int | None
    ) -> None:
        self.sample_prefill(name, now)
        b = self.backends[name]
        if kv is not None:
            b.kv_blocks = kv
        b.seen_at, b.kv_usage = now, usage
        rose = False
        if preemptions is not None:
            rose = b.preemptions is not None and preemptions > b.preemptions
            b.preemptions = preemptions
        self.tick(now)
        cooldown = us(self.config["preemption_cooldown_ms"])
        if rose and cooldown is not None:
            self.shed_level = min(self.shed_level + 1, MAX_SHED_LEVEL)
            self.breaker_until = now + cooldown
