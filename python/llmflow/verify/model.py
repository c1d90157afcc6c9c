"""An independent reference of the runtime's rules, for the state machine in `machine.py`.

It is written from the config and the documented rules, never from the core's state: the host
machine feeds it what it sent (arrivals, tokens, scrapes, window events, the drain) and what it
carried out (`Start`, `Wait`, terminal actions). From that it knows which backends are healthy,
the preemption breaker's level, each backend's last scrape and KV estimate, which requests run
where with how many tokens, and every pending deadline. It answers three questions: may a
request of this tier start on this backend now (`allows`), could any waiting request have been
started (`stranded`), and what ends a request at a given time (`due`). It keeps no fair order,
no estimates and no Retry-After arithmetic. It never serves a request: only the state machine
(`llmflow config verify` and the property tests) runs it. The placement and deadline rules it
shares with the governor's reference (`property_tests/models.py`) are `rules.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmflow.verify import rules
from llmflow.verify.rules import MAX_SHED_LEVEL, us

EXPIRIES = ("queue_timeout", "first_token_timeout", "deadline")  # the core's tie-break order
DEFAULT_SCRAPE_FAILURES = 2  # the runtime's, when a config (the gateway's) does not set it


@dataclass
class Req:
    tenant: str
    tier: int
    prompt: int
    stream: bool
    arrived: int
    waited: bool = False  # got `Wait`: its queue deadline runs until `Start`
    backend: str | None = None  # set by `Start`
    started_at: int = 0
    generated: int = 0
    first_token: bool = False
    stall_at: int | None = None
    lingering: bool = False  # upstream done while the window was full: slot freed, reply open


@dataclass
class Backend:
    cap: int
    kv_capacity: int
    healthy: bool = True
    ever_scraped: bool = False
    failures: int = 0
    unreachable: int = 0  # scrapes in a row nothing answered
    down_at: int | None = None  # a request found it unreachable then
    scraped_at: int | None = None
    kv_usage: float | None = None
    preemptions: int | None = None


class RuntimeModel:
    """What the runtime must respect, derived from the config and the host's own records."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.policy = p = config["policy"]
        self.life = config["lifecycle"]
        self.tiers = p["tiers"]
        tier_index = {t["name"]: i for i, t in enumerate(self.tiers)}
        self.tenant_tier = {t["name"]: tier_index[t["tier"]] for t in p["tenants"]}
        per_gpu = p["max_concurrency_per_gpu"]
        self.backends = {
            b["name"]: Backend(b["gpus"] * per_gpu, b["kv_blocks"]) for b in p["backends"]
        }
        self.live: dict[int, Req] = {}
        self.level, self.level_until = 0, 0
        self.drain_at: int | None = None
        self.draining = False

    # ---- what the host sent and carried out --------------------------------------------------

    def arrive(self, rid: int, tenant: str, prompt: int, stream: bool, now: int) -> Req:
        self.live[rid] = Req(tenant, self.tenant_tier[tenant], prompt, stream, now)
        return self.live[rid]

    def start(self, rid: int, backend: str, now: int) -> None:
        req = self.live[rid]
        req.backend, req.started_at = backend, now

    def tokens(self, rid: int, n: int) -> None:
        req = self.live[rid]
        if not req.lingering:
            req.generated += n
            req.first_token = True

    def done(self, rid: int) -> bool:
        """Upstream finished: True when the reply ends now, False when it lingers (the client's
        window is full: the slot is free, the reply ends on drained or on the stall timer)."""
        req = self.live[rid]
        if req.stall_at is None:
            return True
        req.lingering = True
        return False

    def window_full(self, rid: int, now: int) -> None:
        req, stall = self.live.get(rid), self.life["stall_timeout_ms"]
        if req is None or req.backend is None or stall is None:
            return
        if req.stall_at is None:
            req.stall_at = now + us(stall)

    def window_drained(self, rid: int) -> None:
        if rid in self.live:
            self.live[rid].stall_at = None

    def drain(self, now: int) -> None:
        if not self.draining:
            self.draining = True
            self.drain_at = now + us(self.life["drain_timeout_ms"])

    def scrape_ok(self, name: str, began: int, now: int, **scrape: Any) -> list[tuple[str, bool]]:
        """Record a scrape; returns the health change it must cause."""
        b = self.backends[name]
        if scrape["kv_blocks"] is not None:
            b.kv_capacity = scrape["kv_blocks"]
        b.scraped_at, b.kv_usage = now, scrape["kv_usage"]
        total, seen = scrape["preemptions_total"], b.preemptions
        if total is not None:
            b.preemptions = total
        self.breaker(now)
        cooldown = self.policy["preemption_cooldown_ms"]
        if total is not None and seen is not None and total > seen and cooldown:
            self.level = min(self.level + 1, MAX_SHED_LEVEL)
            self.level_until = now + us(cooldown)
        b.failures, b.unreachable, b.ever_scraped = 0, 0, True
        if not b.healthy and (b.down_at is None or began > b.down_at):
            b.healthy = True
            return [(name, True)]
        return []

    def scrape_failed(self, name: str, reachable: bool = False) -> list[tuple[str, bool]]:
        """Only scrapes nothing answered count towards down; one it answered without metrics
        leaves it up, its metrics ageing into the stale rule (unless it was never scraped)."""
        b = self.backends[name]
        b.failures += 1
        b.unreachable = 0 if reachable else b.unreachable + 1
        before_down = self.life.get("scrape_failures_before_down", DEFAULT_SCRAPE_FAILURES)
        enough = b.unreachable >= before_down or not b.ever_scraped
        if b.healthy and enough:
            b.healthy = False
            return [(name, False)]
        return []

    def unreachable(self, rid: int, now: int) -> list[tuple[str, bool]]:
        """A running request found its backend unreachable."""
        name = self.live[rid].backend
        if name is None:
            return []
        b = self.backends[name]
        b.down_at = now
        if b.healthy:
            b.healthy = False
            return [(name, False)]
        return []

    # ---- derived state -----------------------------------------------------------------------

    def breaker(self, now: int) -> int:
        """The breaker level at `now`: one level off per elapsed cool-down."""
        cooldown = self.policy["preemption_cooldown_ms"]
        self.level, self.level_until = rules.cooled(self.level, self.level_until, now, cooldown)
        return self.level

    def running(self, name: str | None = None, tier: int | None = None) -> list[Req]:
        return [
            r
            for r in self.live.values()
            if r.backend is not None
            and not r.lingering
            and name in (None, r.backend)
            and tier in (None, r.tier)
        ]

    def waiting(self, tier: int | None = None) -> list[Req]:
        return [r for r in self.live.values() if r.backend is None and tier in (None, r.tier)]

    def blocks(self, tokens: int) -> int:
        return rules.blocks(tokens, int(self.policy["block_size"]))

    def ledger(self, name: str | None = None) -> int:
        return sum(self.blocks(r.prompt + r.generated) for r in self.running(name))

    def stale(self, b: Backend, now: int) -> bool:
        return rules.stale(now, b.scraped_at, self.policy["stale_after_ms"])

    def kv_usage(self, name: str, now: int) -> float:
        b = self.backends[name]
        return rules.kv_usage(b.kv_usage, self.ledger(name), b.kv_capacity, self.stale(b, now))

    def fits(self, name: str, prompt: int, now: int) -> bool:
        b, busy = self.backends[name], bool(self.running(name))
        usage = self.kv_usage(name, now)
        return rules.kv_fits(self.blocks(prompt), b.kv_capacity, busy, usage, self.ledger(name))

    def allows(self, tier: int, prompt: int, name: str, now: int) -> bool:
        """Whether every rule lets a request of `tier` with `prompt` start on `name` now."""
        b, t = self.backends[name], self.tiers[tier]
        if not b.healthy:
            return False
        level = 0 if t["protected"] else self.breaker(now)
        total, share = rules.slot_limits(b.cap, t, self.stale(b, now), level)
        if len(self.running(name)) >= total or len(self.running(name, tier)) >= share:
            return False
        if t["protected"]:
            return True
        threshold = self.policy["kv_pressure_threshold"]
        if threshold is not None and self.kv_usage(name, now) > threshold:
            return False
        return self.fits(name, prompt, now)

    def fit_target_binds(self, backend: str) -> bool:
        """With `kv_fit_target`, a busy backend of known size may decline a request whose
        expected peak (prompt plus the tenant's learned output, which this model does not know)
        does not fit what its running requests are expected to hold."""
        if self.policy.get("kv_fit_target") is None:
            return False
        return bool(self.backends[backend].kv_capacity and self.running(backend))

    def in_prefill(self, backend: str) -> bool:
        """Whether a request started on `backend` still waits for its first token."""
        return any(r.backend == backend and not r.first_token for r in self.live.values())

    def stranded(self, now: int) -> tuple[int, str] | None:
        """A (tier, backend) where the head of the tier's queue, whichever it is, could start."""
        for tier in range(len(self.tiers)):
            if self.tiers[tier].get("best_effort"):
                # It may wait beside slots kept free as the latency tiers' headroom (Erlang C
                # on measured rates, which this model does not compute): not work-conserving.
                continue
            queued = self.waiting(tier)
            if not queued:
                continue
            # With headroom on, unprotected prompts join a backend's prefill only at the pace
            # its measured prefill rate clears them (which this model does not know).
            paced = self.policy.get("headroom_quantile") is not None
            paced = paced and not self.tiers[tier]["protected"]
            biggest = max(r.prompt for r in queued)  # fits => every smaller prompt fits
            for name in self.backends:
                if paced and self.in_prefill(name):
                    continue
                if self.fit_target_binds(name):
                    continue
                if self.allows(tier, biggest, name, now):
                    return tier, name
        return None

    # ---- deadlines ---------------------------------------------------------------------------

    def deadlines(self, req: Req) -> list[tuple[int, int]]:
        """The governor's pending deadlines of a request: (at, index into EXPIRIES)."""
        if req.lingering:
            return []
        queued = req.waited and req.backend is None
        started = None if req.backend is None else req.started_at
        return rules.deadlines(
            self.policy, req.arrived, queued, started, req.first_token, req.prompt
        )

    def due(self, rid: int, now: int) -> str | None:
        """What ends the request when the timer fires at `now`: the earliest governor deadline,
        else its stalled window, else the end of the drain."""
        req = self.live[rid]
        passed = [d for d in self.deadlines(req) if d[0] <= now]
        if passed:
            return EXPIRIES[min(passed)[1]]
        if req.stall_at is not None and req.stall_at <= now:
            return "client_stall"
        if self.drain_at is not None and self.drain_at <= now:
            return "shutdown"
        return None

    def next_due(self, now: int) -> int | None:
        """The earliest time something is pending: a deadline, a stall, the drain's end, or the
        breaker cooling down a level (which frees room)."""
        times = [at for r in self.live.values() for at, _ in self.deadlines(r)]
        times += [r.stall_at for r in self.live.values() if r.stall_at is not None]
        if self.drain_at is not None:
            times.append(self.drain_at)
        if self.breaker(now) > 0 and self.policy["preemption_cooldown_ms"]:
            times.append(self.level_until)
        return min(times, default=None)

    def render(self, rid: int, reason: str) -> tuple[bool, tuple[Any, ...]]:
        """(aborts upstream, terminal signature) of a request ended by `reason` at the timer."""
        req = self.live[rid]
        if reason == "first_token_timeout" and self.life["first_token_error"]:
            return True, ("Reply", 504, reason)
        if req.backend is not None:
            return not req.lingering, ("Cut", reason)
        return False, ("Reply", 503, reason)
