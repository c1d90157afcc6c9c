"""Random interleavings of the request lifecycle against the reference model.

Every rule is one event followed by the `dispatch` a host makes after every event. Covers, after
every rule: work conservation (no queued request that could start is left queued: each tier's
head, under the cap halved by stale metrics and by the breaker, `max_share`, KV pressure and KV
fit); every admission is its tier's head in fair (VTC) order, no more important tier could start
one, and it goes to the backend with the most room; every decision (kind, reason, backend,
displaced request, position, priority) matches the model; `expire` ends exactly the requests
whose deadlines the model computed from the config, with their reasons; running <= cap; a
newcomer queues only within the model's room (max_waiting, or what a latency tier drains within
the queue's wait limit); the KV ledger, per-request blocks, staleness, KV usage, breaker level,
prefill estimates and tenant service agree with the model; each request ends exactly once and
nothing is left when idle; VIP is never refused while normal would be let in; every refusal has
a positive Retry-After; the same events always give the same answers. Two machines: optional
checks off (`GovernorMachine`), and every check on (`AllChecksMachine`).
"""

from __future__ import annotations

import copy
import math
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from llmflow import Admitted, Governor, Queued, Rejected
from property_tests import strategies as s
from property_tests.models import ReferenceGovernor, us

OUTCOMES = ("completed", "error", "cancelled")
STATES = {(False, False): "queued", (True, False): "prefill", (True, True): "streaming"}


class GovernorMachine(RuleBasedStateMachine):
    """Drives `llmflow._core.Governor` and `ReferenceGovernor` through the same events."""

    ids = Bundle("ids")

    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.next_id = 1
        self.log: list[tuple[str, tuple[Any, ...], Any]] = []

    @initialize(config=s.permissive_configs)
    def build(self, config: dict[str, Any]) -> None:
        self.setup(config)

    def setup(self, config: dict[str, Any]) -> None:
        self.config = config
        self.core = Governor(config)
        self.model = ReferenceGovernor(config)
        self.learns_kv = any(b["kv_blocks"] for b in config["backends"])

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        result = getattr(self.core, method)(*args, **kwargs)
        self.log.append((method, (*args, tuple(sorted(kwargs.items()))), _plain(result)))
        return result

    # ---- rules -------------------------------------------------------------------------------

    @rule(
        target=ids,
        tenant=s.tenants,
        prompt=s.prompt_tokens,
        max_tokens=s.max_tokens,
        dt=s.time_steps_us,
    )
    def submit(self, tenant: str, prompt: int, max_tokens: int, dt: int) -> int:
        self.now += dt
        self.expire()
        return self.submit_now(tenant, prompt, max_tokens)

    @rule(target=ids, tenant=s.tenants, count=st.integers(2, 8), prompt=s.prompt_tokens)
    def burst(self, tenant: str, count: int, prompt: int) -> Any:
        """Many requests of one tenant at once: fills queues and provokes displacement."""
        return multiple(*(self.submit_now(tenant, prompt, 64) for _ in range(count)))

    def submit_now(self, tenant: str, prompt: int, max_tokens: int) -> int:
        m = self.model
        m.tick(self.now)
        m.lapse(self.now)
        m.arrive(tenant)
        m.count(tenant, self.now)
        kind, detail = m.decide(tenant, prompt, max_tokens, self.now)
        rid = self.next_id
        self.next_id += 1
        before = copy.copy(self.core) if tenant in s.VIPS else None
        decision = self.call("submit", rid, tenant, prompt, max_tokens, self.now)
        # submit dispatches the request it queues (it comes back admitted when it can start);
        # the other requests that dispatch started come out of the next `dispatch`, which a
        # host calls after every event (a refusal too: an expiry may have freed a slot).
        handed = self.call("dispatch", self.now)
        tier = m.tenants[tenant].tier
        match decision:
            case Rejected(reason=reason, retry_after_s=retry):
                assert ("rejected", reason) == (kind, detail), (decision, kind, detail)
                assert retry > 0
                if before is not None:
                    self.check_vip_not_shed_before_normal(before)
                self.follow(handed)
            case Admitted(backend=backend, priority=priority):
                assert kind in ("admitted", "queued"), (decision, kind, detail)
                assert priority == m.priority(tier, prompt + m.expected_output(tenant, max_tokens))
                if kind == "admitted":
                    assert backend == detail, (decision, detail)
                    m.add(rid, tenant, prompt, self.now, backend)
                    self.follow(handed)
                else:
                    m.add(rid, tenant, prompt, self.now, None)
                    self.follow(handed, own=(rid, backend))
            case Queued(displaced=displaced, displaced_retry_after_s=retry, position=position):
                assert kind == "queued", (decision, kind, detail)
                assert decision.priority == m.priority(
                    tier, prompt + m.expected_output(tenant, max_tokens)
                )
                m.add(rid, tenant, prompt, self.now, None)
                self.follow(handed)
                # Nobody is pushed out when the dispatch made room.
                victim = None if handed else detail
                assert displaced == victim, (decision, detail, handed)
                if victim is not None:
                    assert retry is not None
                    assert retry > 0
                    m.finish(victim)
                assert position == m.ahead(tier) - 1, (decision, m.queued(tier))
        return rid

    @precondition(lambda self: self.fit_blocked())
    @rule(index=st.integers(0, 10**6))
    def squeeze(self, index: int) -> None:
        """A small request of a tier below one whose head waits for KV room: it may start."""
        tier = min(self.fit_blocked())
        names = [n for n, t in self.model.tenants.items() if t.tier > tier]
        self.submit_now(names[index % len(names)], 0, 1)

    def fit_blocked(self) -> list[int]:
        """Tiers above the last whose head could start but for the KV fit of its prompt."""
        m, tiers = self.model, self.config["tiers"]
        return [
            tier
            for tier in range(len(tiers) - 1)
            if m.head(tier) is not None
            and not tiers[tier]["protected"]
            and m.placeable(tier, 0, self.now)
        ]

    def check_vip_not_shed_before_normal(self, before: Governor) -> None:
        for normal in s.NORMALS:
            probe = copy.copy(before).submit(10**9, normal, 1, 1, self.now)
            assert isinstance(probe, Rejected), f"VIP refused while {normal} gets in: {probe}"

    @rule()
    def dispatch(self) -> None:
        self.settle()

    def pick(self, index: int, running: bool = False) -> int | None:
        """A live request (a running one if `running`), by index, so events find live work."""
        live = sorted(r for r, req in self.model.live.items() if req.backend or not running)
        return live[index % len(live)] if live else None

    @rule(index=st.integers(0, 10**6), n=st.integers(0, 40), dt=s.time_steps_us)
    def tokens(self, index: int, n: int, dt: int) -> None:
        self.feed(self.pick(index), n, dt)

    @rule(rid=ids, n=st.integers(1, 40))
    def stray_tokens(self, rid: int, n: int) -> None:
        """Tokens for any id ever submitted: refused and ended ones must ignore them."""
        self.feed(rid, n, 0)

    def feed(self, rid: int | None, n: int, dt: int) -> None:
        self.now += dt // 10
        if rid is not None:
            self.call("on_tokens", rid, n, self.now)
            self.model.on_tokens(rid, n, self.now)
        self.settle()

    @rule(index=st.integers(0, 10**6), dt=s.time_steps_us)
    def first_token(self, index: int, dt: int) -> None:
        self.now += dt // 10
        rid = self.pick(index)
        if rid is not None:
            self.call("on_first_token", rid, self.now)
            self.model.on_first_token(rid, self.now)
        self.settle()

    @rule(rid=consumes(ids), outcome=st.sampled_from(OUTCOMES))
    def finish(self, rid: int, outcome: str) -> None:
        self.end(rid, outcome)

    @rule(index=st.integers(0, 10**6), outcome=st.sampled_from(OUTCOMES))
    def complete(self, index: int, outcome: str) -> None:
        """A running request ends (bundled ids are mostly refused or ended already)."""
        rid = self.pick(index, running=True)
        if rid is not None:
            self.end(rid, outcome)

    def end(self, rid: int, outcome: str) -> None:
        assert self.call("finish", rid, outcome, self.now) == self.model.finish(
            rid, outcome, self.now
        )
        assert self.call("finish", rid, outcome, self.now) is False, "ended twice"
        self.settle()

    @rule(dt=s.time_steps_us)
    def advance(self, dt: int) -> None:
        self.now += dt * 4
        self.expire()
        self.settle()

    @rule(index=st.integers(0, 10**6), offset=st.sampled_from((0, -1, 1)))
    def to_the_edge(self, index: int, offset: int) -> None:
        """Move time to just before, at or just after the model's next deadline, the breaker's
        next cool-down or a backend going stale, where an off-by-one would show."""
        m = self.model
        stale = us(self.config["stale_after_ms"])
        edges = [m.next_deadline(), m.breaker_until if m.shed_level else None]
        edges += [b.seen_at + stale for b in m.backends.values() if b.seen_at and stale]
        edges = sorted(t + offset for t in edges if t is not None and t + offset >= self.now)
        if edges:
            self.now = edges[index % len(edges)]
            self.expire()
            self.settle()

    @rule(
        backend=st.integers(0, 1),
        usage=st.none() | st.floats(0, 0.5) | st.floats(0, 1),
        preemptions=st.none() | st.integers(0, 4),
        kv_blocks=st.none() | st.integers(24, 160),
    )
    def observe(
        self, backend: int, usage: float | None, preemptions: int | None, kv_blocks: int | None
    ) -> None:
        name = f"b{backend}"
        if name not in self.model.backends:
            return
        kv_blocks = kv_blocks if self.learns_kv else None
        self.call(
            "observe_backend",
            name,
            self.now,
            kv_usage=usage,
            preemptions_total=preemptions,
            kv_blocks=kv_blocks,
        )
        self.model.observe(name, self.now, usage, preemptions, kv_blocks)
        self.settle()

    @rule(backend=st.integers(0, 1), healthy=st.sampled_from((True, True, False)))
    def health(self, backend: int, healthy: bool) -> None:
        name = f"b{backend}"
        if name in self.model.backends:
            self.call("set_backend_health", name, healthy)
            self.model.backends[name].healthy = healthy
            self.settle()

    @precondition(lambda self: len(self.log) > 200)
    @rule()
    def drain(self) -> None:
        """Start draining, late in a run: nothing is let in afterwards."""
        self.call("start_draining")
        self.model.draining = True
        self.settle()

    # ---- checks ------------------------------------------------------------------------------

    def expire(self) -> None:
        expired = self.call("expire", self.now)
        got = [(e.request_id, e.reason, e.was_running, e.backend) for e in expired]
        assert got == self.model.expire(self.now), "expiries differ from the model's deadlines"
        assert all(e.retry_after_s > 0 for e in expired)

    def settle(self) -> None:
        """The dispatch a host makes after every event."""
        self.model.tick(self.now)
        self.model.lapse(self.now)
        self.follow(self.call("dispatch", self.now))

    def follow(self, admissions: list[Any], own: tuple[int, str] | None = None) -> None:
        """Check the core's admissions one by one, in the order it made them, and apply them.

        `own` is the request `submit` started from the queue: it went when it was its tier's
        head, between the others `submit`'s dispatch started (returned by `dispatch`).
        """
        rest = [(a.request_id, a.backend) for a in admissions]
        while rest or own:
            if own is not None:
                tier = self.model.live[own[0]].tier
                first = self.model.live[rest[0][0]].tier if rest else math.inf
                if first > tier or (first == tier and self.model.head(tier) == own[0]):
                    rest.insert(0, own)
                    own = None
            self.place(*rest.pop(0))

    def place(self, rid: int, backend: str) -> None:
        m = self.model
        req = m.live.get(rid)
        assert req is not None, f"admitted {rid}, which is not live"
        assert req.backend is None, f"admitted {rid}, which was not queued"
        skipped = [(r, b) for r, b in m.stuck(self.now) if m.live[r].tier < req.tier]
        assert not skipped, f"admitted {rid} while a more important tier could start {skipped}"
        head = m.head(req.tier)
        assert head == rid, f"admitted {rid} out of fair order (the head is {head})"
        where = m.placeable(req.tier, req.prompt, self.now)
        assert where, f"admitted {rid} on {backend}, where no rule lets it start"
        assert backend == where[0], f"admitted {rid} on {backend}, not on the roomiest {where}"
        m.start(rid, backend, self.now)

    @invariant()
    def work_conserving(self) -> None:
        if hasattr(self, "core"):
            stuck = self.model.stuck(self.now)
            assert not stuck, f"left queued though each could start (id, backend): {stuck}"

    @invariant()
    def agrees_with_model(self) -> None:
        if not hasattr(self, "core"):
            return
        m, snap = self.model, self.core.snapshot(self.now)
        assert snap["shed_level"] == m.shed_level
        for b in snap["backends"]:
            name = b["name"]
            assert b["running"] <= b["cap"]
            assert b["running"] == len(m.running(name))
            assert b["kv_blocks_reserved"] == m.ledger(name)
            assert b["kv_capacity_blocks"] == m.backends[name].kv_blocks
            assert b["stale"] == m.stale(name, self.now)
            assert b["kv_usage"] == m.usage(name, self.now)
            assert math.isclose(b["prefill_tokens_per_s"], m.backends[name].prefill_tps)
        # max_waiting bounds the queue unless a tier may hold what it drains within the queue's
        # wait limit (each newcomer's room is checked where its decision is compared)
        assert snap["queued"] == len(m.queued())
        follows = self.config.get("queue_follows_drain", True)
        if self.config["queue_timeout_ms"] is None or not follows:
            assert snap["queued"] <= self.config["max_waiting"]
        assert self.core.live == len(m.live)
        assert self.core.kv_blocks_in_use == m.ledger()
        assert self.core.next_deadline_us() == m.next_deadline()
        for r in snap["requests"]:
            req = m.live[r["id"]]
            assert r["state"] == STATES[req.backend is not None, req.first_token]
            assert (r["backend"], r["generated_tokens"]) == (req.backend, req.generated)
            assert r["kv_blocks"] == (m.blocks(req.prompt + req.generated) if req.backend else 0)
        for t in snap["tenants"]:
            tenant = m.tenants[t["name"]]
            assert t["queued"] == len(tenant.queue)
            assert math.isclose(t["service"], tenant.service, rel_tol=1e-9, abs_tol=1e-9)
        if not m.live:
            assert (self.core.kv_blocks_in_use, self.core.running, self.core.queued) == (0, 0, 0)

    def teardown(self) -> None:
        if not hasattr(self, "core"):
            return
        replay = Governor(self.config)
        for method, args, result in self.log:
            *positional, kwargs = args
            assert _plain(getattr(replay, method)(*positional, **dict(kwargs))) == result


class AllChecksMachine(GovernorMachine):
    """The same, with the TTFT SLA, the breaker, stale metrics, KV pressure and KV fit all on."""

    @initialize(config=s.strict_configs)
    def build(self, config: dict[str, Any]) -> None:
        self.setup(config)


def _plain(value: Any) -> Any:
    """A comparable form of a core result (decisions, admissions and lists of them)."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if type(value).__module__ == "llmflow._core":
        fields = sorted(name for name in dir(value) if not name.startswith("_"))
        return (type(value).__name__, *(getattr(value, name) for name in fields))
    return value


TestGovernorMachine = GovernorMachine.TestCase
TestAllChecksMachine = AllChecksMachine.TestCase
# Caps, queues, KV, deadlines and the breaker each need a few dozen steps to bind.
TestGovernorMachine.settings = settings(TestGovernorMachine.settings, stateful_step_count=100)
TestAllChecksMachine.settings = settings(TestAllChecksMachine.settings, stateful_step_count=100)
