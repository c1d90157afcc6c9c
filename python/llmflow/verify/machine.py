"""The whole sans-IO runtime under a random host, checked from outside against `RuntimeModel`.

One machine serves two callers: `property_tests/test_runtime_machine.py` runs it over random
configs, and `llmflow config verify` over the user's own (`machine_for`). The world it explores
is the config's tenants, tiers, backends, caps and limits, under random arrivals, tokens,
failures, disconnects, slow readers, scrapes, timer firings and the drain.

Covers, after every event (every check on: tiers with a protected VIP tier, max_share, TTFT SLA,
KV pressure, KV fit, the preemption breaker, stale metrics, every deadline, the stall timer,
backend health, the drain):
- each arrived id ends with exactly one terminal action, and the one its event calls for (a
  reply whose upstream finished while the client's window was full lingers, slot freed, until
  the window drains or the stall timer cuts it); no action names an unknown or ended id;
  `Start` at most once; `Abort` only for a started id, at most once, before its terminal action
  in the same call;
- `live`/`running`/`queued`/KV blocks equal the host's own counts; no backend holds more than
  its cap; every `Start` is allowed by every rule of the model; everything returns to zero;
- work conservation: no waiting request could have started on some backend;
- a VIP is never refused while a non-protected arrival would get in (probed on a copy);
- every Retry-After is whole seconds >= 1, non-decreasing across a crowd refused at once;
- the timer: armed no later than the earliest pending deadline, and firing it (early, on time or
  late) renders exactly what is due;
- determinism: the events replay to the same actions, and the trace replays.
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from llmflow._core import Abort, Arm, Cut, End, Reply, Runtime, SetHealth, Start, Wait, replay_trace
from llmflow.verify.model import RuntimeModel

__all__ = ["PROMPTS", "STEPS", "RuntimeMachine", "machine_for"]

PROMPTS = st.one_of(st.integers(0, 200), st.integers(0, 2000))  # tokens; KV holds 320-4800
STEPS = st.one_of(st.just(0), st.integers(1, 20_000), st.integers(20_000, 2_500_000))  # µs
PROBE_ID = 10**15  # an id the machine never uses
REFUSED = {"queue_full", "tier_shed", "kv_pressure", "ttft_sla", "preemption_breaker"}
REFUSED_VIP = {"queue_full", "tier_shed", "draining", "no_healthy_backend"}


def signature(action: Any) -> tuple[Any, ...]:
    if isinstance(action, Reply):
        return ("Reply", action.status, action.reason)
    if isinstance(action, Cut):
        return ("Cut", action.reason)
    return ("End", action.outcome)


def own(actions: list[Any], rid: int) -> Any:
    return next(a for a in actions if getattr(a, "request_id", None) == rid)


class RuntimeMachine(RuleBasedStateMachine):
    """A host that keeps its own books: what it sent, what it was told, and one timer.

    Subclasses (`machine_for`) set `configs`, the runtime configs to explore, and may set
    `max_running`, invariants of the user's own: at most N requests of a tenant run at once.
    """

    configs: st.SearchStrategy[dict[str, Any]] = st.nothing()
    max_running: dict[str, int] = {}  # noqa: RUF012 - read-only, set per subclass
    last: RuntimeMachine | None = None  # the latest run (after a failure: the shrunk one)

    def __init__(self) -> None:
        super().__init__()
        type(self).last = self
        self.rt: Runtime | None = None
        self.broken = False  # a check failed: teardown must not mask it
        self.steps = 0

    @invariant()
    def count_steps(self) -> None:
        self.steps += 1

    @initialize(
        data=st.data(),
        lateness=st.sampled_from([0, 0, 1, 300_000]),
        run_out=st.booleans(),
    )
    def build(self, data: st.DataObject, lateness: int, run_out: bool) -> None:
        """`lateness`: how late the host's timer may fire; `run_out`: at the end, let the clock
        run until every deadline has passed (else every client leaves)."""
        config = data.draw(self.configs, label="config")
        self.config, self.lateness, self.run_out = config, lateness, run_out
        policy = config["policy"]
        self.tenants = [t["name"] for t in policy["tenants"]]
        protected_tiers = {t["name"] for t in policy["tiers"] if t.get("protected")}
        self.protected = {t["name"] for t in policy["tenants"] if t["tier"] in protected_tiers}
        self.rt = Runtime(config, trace=True)
        self.model = RuntimeModel(config)
        self.now, self.next_id = 0, 1
        self.armed: int | None = None  # the host's one timer
        self.arrived: set[int] = set()
        self.started_ids: set[int] = set()  # got `Start`
        self.headers: set[int] = set()  # the host told the runtime `started`
        self.ended: set[int] = set()
        self.preemptions = dict.fromkeys(self.model.backends, 0)
        self.events: list[tuple[str, tuple[Any, ...], dict[str, Any], int]] = []
        self.log: list[list[str]] = []
        for name in self.model.backends:  # a host scrapes every backend as it starts
            self.scrape(name, 0.0, 0, None, 0)

    def scrape(
        self, name: str, kv_usage: float | None, total: int | None, blocks: int | None, lag: int
    ) -> None:
        began = max(self.now - lag, 0)
        scrape: dict[str, Any] = {
            "kv_usage": kv_usage,
            "preemptions_total": total,
            "kv_blocks": blocks,
        }
        health = self.model.scrape_ok(name, began, self.now, **scrape)
        self.feed("scrape_ok", name, began, expect={}, health=health, **scrape)

    # ---- the host ------------------------------------------------------------------------------

    def advance(self, dt: int) -> None:
        """Move time on, firing the timer whenever it comes due (`lateness` late at most)."""
        target = self.now + dt
        for _ in range(200):
            if self.armed is None or self.armed > target:
                break
            self.now = max(self.now, min(self.armed + self.lateness, target))
            self.fire()
        else:
            raise AssertionError(f"the timer keeps firing at {self.now}: re-armed in the past?")
        self.now = target

    def fire(self) -> None:
        """The timer fires now (maybe early): exactly what is due must end, as it is due."""
        m = self.model
        expect = {}
        for rid in m.live:
            reason = m.due(rid, self.now)
            if reason is not None:
                expect[rid] = m.render(rid, reason)
        if m.drain_at is not None and m.drain_at <= self.now:
            m.drain_at = None
        self.armed = None
        self.feed("timer", expect=expect)

    def feed(
        self,
        method: str,
        *args: Any,
        expect: dict[int, tuple[bool, tuple[Any, ...]]],
        health: list[tuple[str, bool]] | None = None,
        arrival: int | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Send one event; carry out and check its actions; check the whole state."""
        assert self.rt is not None
        try:
            actions: list[Any] = getattr(self.rt, method)(*args, self.now, **kwargs)
            self.events.append((method, args, kwargs, self.now))
            self.log.append([repr(a) for a in actions])
            context = f"{method}{args} at {self.now}: {actions}"
            self.carry_out(actions, expect, health or [], arrival, context)
            self.check(context)
        except BaseException:
            self.broken = True
            raise
        return actions

    def carry_out(
        self,
        actions: list[Any],
        expect: dict[int, tuple[bool, tuple[Any, ...]]],
        health: list[tuple[str, bool]],
        arrival: int | None,
        context: str,
    ) -> None:
        m = self.model
        aborted: set[int] = set()
        ended: dict[int, tuple[bool, tuple[Any, ...]]] = {}
        was: dict[int, Any] = {}  # ended requests as the model last knew them
        changes = []
        for i, a in enumerate(actions):
            if isinstance(a, Arm):
                assert a.at_us >= self.now, context
                self.armed = a.at_us
                continue
            if isinstance(a, SetHealth):
                changes.append((a.backend, a.healthy))
                continue
            rid = a.request_id
            assert rid in self.arrived, f"{a!r} names an id never arrived; {context}"
            assert rid not in self.ended, f"{a!r} after its terminal action; {context}"
            if isinstance(a, Start):
                req = m.live[rid]
                assert rid not in self.started_ids, f"started twice; {context}"
                assert m.allows(req.tier, req.prompt, a.backend, self.now), (
                    f"{a!r} breaks a rule: {req}; {context}"
                )
                self.started_ids.add(rid)
                event("Start after Wait" if m.live[rid].waited else "Start")
                m.start(rid, a.backend, self.now)
            elif isinstance(a, Wait):
                assert rid == arrival, context
                m.live[rid].waited = True
            elif isinstance(a, Abort):
                assert rid in self.started_ids, context
                assert rid not in aborted, context
                later = [b for b in actions[i + 1 :] if getattr(b, "request_id", None) == rid]
                assert any(isinstance(b, Reply | Cut | End) for b in later), context
                aborted.add(rid)
            else:
                self.check_retry_after(a, context)
                ended[rid] = (rid in aborted, signature(a))
                event(" ".join(map(str, signature(a))))  # for --hypothesis-show-statistics
                self.ended.add(rid)
                was[rid] = m.live.pop(rid)
        assert changes == health, f"health changes {changes} != {health}; {context}"
        for rid, want in expect.items():
            assert ended.get(rid) == want, f"#{rid}: want {want}, got {ended.get(rid)}; {context}"
        for rid, (_, sig) in ended.items():
            if rid in expect:
                continue
            if rid == arrival:
                self.check_refusal(was[rid].tier, sig, context)
            else:
                assert arrival is not None, f"#{rid} ended unexpectedly; {context}"
                assert sig == ("Reply", 429, "displaced"), f"#{rid} ended unexpectedly; {context}"
                victim, newcomer = was[rid], was.get(arrival) or m.live[arrival]
                assert victim.backend is None, context
                assert victim.waited, context
                assert victim.tier >= newcomer.tier, f"displaced a more important tier; {context}"

    def check_refusal(self, tier: int, sig: tuple[Any, ...], context: str) -> None:
        m = self.model
        _, status, reason = sig
        assert status == (503 if reason in ("draining", "no_healthy_backend") else 429), context
        assert reason in REFUSED | {"draining", "no_healthy_backend"}, context
        if m.tiers[tier]["protected"]:
            assert reason in REFUSED_VIP, f"a VIP refused for {reason}; {context}"
        if m.draining:
            assert reason == "draining", context
        elif not any(b.healthy for b in m.backends.values()):
            assert reason == "no_healthy_backend", context

    @staticmethod
    def check_retry_after(a: Any, context: str) -> None:
        if not isinstance(a, Reply):
            return
        if a.reason in ("upstream_error", "shutdown"):
            assert a.retry_after_s is None, context
        else:
            assert isinstance(a.retry_after_s, int), context
            assert a.retry_after_s >= 1, context

    def check(self, context: str) -> None:
        m, rt = self.model, self.rt
        assert rt is not None
        counts = (len(m.live), len(m.running()), len(m.waiting()))
        assert (rt.live, rt.running, rt.queued) == counts, context
        # max_waiting bounds the queue unless a latency tier may also hold what it drains within
        # the queue's wait limit (a measured rate this model does not compute; property_tests'
        # governor machine checks that room exactly)
        policy = self.config["policy"]
        if policy["queue_timeout_ms"] is None or not policy.get("queue_follows_drain", True):
            assert len(m.waiting()) <= self.config["policy"]["max_waiting"], context
        assert rt.kv_blocks_in_use == m.ledger(), context
        if m.waiting() and any(len(m.running(n)) < b.cap for n, b in m.backends.items()):
            event("waiting beside a free slot")
        if m.level:
            event(f"breaker level {m.level}")
        if any(m.stale(b, self.now) for b in m.backends.values()):
            event("stale metrics")
        for name, b in m.backends.items():
            assert len(m.running(name)) <= b.cap, f"cap exceeded: {name} over its cap; {context}"
        for tenant, most in self.max_running.items():
            running = sum(1 for r in m.running() if r.tenant == tenant)
            assert running <= most, (
                f"your invariant broken: tenant {tenant} runs {running} requests at once, "
                f"you expect at most {most}; {context}"
            )
            assert rt.backend_healthy(name) == b.healthy, context
        assert rt.shed_level == m.breaker(self.now), context
        pending = m.next_due(self.now)
        if pending is not None:
            assert self.armed is not None, f"nothing armed, pending {pending}; {context}"
            assert self.armed <= pending, f"armed {self.armed}, pending {pending}; {context}"
        stranded = m.stranded(self.now)
        assert stranded is None, f"tier {stranded} could start a waiting request; {context}"

    # ---- requests ----------------------------------------------------------------------------

    def arrive_one(self, tenant: str, prompt: int, max_tokens: int, stream: bool) -> Any:
        assert self.rt is not None
        rid, self.next_id = self.next_id, self.next_id + 1
        before = copy.copy(self.rt) if tenant in self.protected else None
        self.arrived.add(rid)
        self.model.arrive(rid, tenant, prompt, stream, self.now)
        args = (rid, tenant, prompt, max_tokens, stream)
        actions = self.feed("arrive", *args, expect={}, arrival=rid)
        first = own(actions, rid)
        assert isinstance(first, Start | Wait | Reply), actions
        if before is not None and isinstance(first, Reply):
            event(f"VIP refused ({first.reason}): probed")
            self.probe(before, first, prompt, max_tokens, stream)
        return first

    def probe(
        self, before: Runtime, vip: Reply, prompt: int, max_tokens: int, stream: bool
    ) -> None:
        """Refused VIP: each non-protected tenant, on a copy, at the same time, is refused too.
        (`Runtime.__copy__` clones the whole state, without the trace.)"""
        for tenant in (name for name in self.tenants if name not in self.protected):
            what_if = copy.copy(before)
            assert not what_if.tracing
            actions = what_if.arrive(PROBE_ID, tenant, prompt, max_tokens, stream, self.now)
            assert isinstance(own(actions, PROBE_ID), Reply), (
                f"a VIP refused ({vip!r}) while {tenant} gets {actions}"
            )
        assert self.rt is not None
        assert not self.rt.is_live(PROBE_ID), "a copy shares state"

    def pick(self, data: st.DataObject, ids: set[int]) -> int | None:
        return data.draw(st.sampled_from(sorted(ids))) if ids else None

    def tenant(self, data: st.DataObject) -> str:
        name: str = data.draw(st.sampled_from(self.tenants), label="tenant")
        return name

    @rule(
        data=st.data(),
        prompt=PROMPTS,
        max_tokens=st.integers(1, 2000),
        stream=st.booleans(),
        dt=STEPS,
    )
    def arrive(
        self, data: st.DataObject, prompt: int, max_tokens: int, stream: bool, dt: int
    ) -> None:
        self.advance(dt)
        self.arrive_one(self.tenant(data), prompt, max_tokens, stream)

    @rule(data=st.data(), prompt=PROMPTS, count=st.integers(2, 8))
    def crowd(self, data: st.DataObject, prompt: int, count: int) -> None:
        """Identical requests at one instant: once refused, told to come back no sooner."""
        tenant = self.tenant(data)
        outcomes = [self.arrive_one(tenant, prompt, 64, True) for _ in range(count)]
        retries = [
            a.retry_after_s or 0 for a in outcomes if isinstance(a, Reply) and a.status == 429
        ]  # a 429 always carries one (`check_retry_after`)
        assert retries == sorted(retries), outcomes

    @rule(data=st.data(), dt=STEPS)
    def started(self, data: st.DataObject, dt: int) -> None:
        self.advance(dt)
        rid = self.pick(data, self.started_ids - self.headers - self.ended)
        if rid is not None:
            self.headers.add(rid)
            self.feed("started", rid, expect={})

    @rule(data=st.data(), n=st.integers(1, 64), dt=st.integers(0, 200_000))
    def tokens(self, data: st.DataObject, n: int, dt: int) -> None:
        self.advance(dt)
        rid = self.pick(data, self.headers - self.ended)
        if rid is not None:
            self.model.tokens(rid, n)
            self.feed("tokens", rid, n, expect={})

    @rule(n=st.integers(1, 16), dt=st.integers(0, 500_000))
    def progress(self, n: int, dt: int) -> None:
        """Every backend makes progress: headers for what started, tokens for all of it."""
        self.advance(dt)
        for rid in sorted(self.started_ids - self.ended):  # neither event ends anything
            if rid not in self.headers:
                self.headers.add(rid)
                self.feed("started", rid, expect={})
            self.model.tokens(rid, n)
            self.feed("tokens", rid, n, expect={})

    @rule(data=st.data(), dt=STEPS)
    def done(self, data: st.DataObject, dt: int) -> None:
        self.advance(dt)
        rid = self.pick(data, self.headers - self.ended)
        if rid is not None:
            self.finish(rid)

    def finish(self, rid: int) -> None:
        if self.model.live[rid].lingering:
            self.feed("done", rid, expect={})
        elif self.model.done(rid):
            self.feed("done", rid, expect={rid: (False, ("End", "completed"))})
        else:
            event("done with a full window: lingers")
            self.feed("done", rid, expect={})  # no terminal until drained or stalled

    @rule(
        data=st.data(),
        status=st.sampled_from([0, 400, 404, 429, 500, 502, 503]),
        down=st.sampled_from([False, False, True]),
        dt=STEPS,
    )
    def failed(self, data: st.DataObject, status: int, down: bool, dt: int) -> None:
        self.advance(dt)
        rid = self.pick(data, self.started_ids - self.ended)
        if rid is None:
            return
        req = self.model.live[rid]
        if req.lingering:
            self.feed("failed", rid, status, expect={}, backend_down=down)
            return
        if req.stream and req.first_token:
            want: tuple[Any, ...] = ("Cut", "upstream_error")
        else:
            want = ("Reply", status if 400 <= status < 500 else 502, "upstream_error")
        health = self.model.unreachable(rid, self.now) if down else []
        expect = {rid: (False, want)}
        self.feed("failed", rid, status, expect=expect, health=health, backend_down=down)

    @rule(data=st.data(), dt=STEPS)
    def client_gone(self, data: st.DataObject, dt: int) -> None:
        self.advance(dt)
        rid = self.pick(data, self.arrived - self.ended)
        if rid is not None:
            self.leave(rid)

    def leave(self, rid: int) -> None:
        req = self.model.live[rid]
        aborts = req.backend is not None and not req.lingering
        self.feed("client_gone", rid, expect={rid: (aborts, ("End", "cancelled"))})

    @rule(data=st.data(), full=st.booleans(), dt=st.integers(0, 1_000_000))
    def window(self, data: st.DataObject, full: bool, dt: int) -> None:
        self.advance(dt)
        rid = self.pick(data, self.arrived - self.ended)
        if rid is None:
            return
        if full:
            self.model.window_full(rid, self.now)
            self.feed("window_full", rid, expect={})
        else:
            lingering = self.model.live[rid].lingering
            self.model.window_drained(rid)
            expect = {rid: (False, ("End", "completed"))} if lingering else {}
            self.feed("window_drained", rid, expect=expect)

    @rule(data=st.data(), dt=st.integers(0, 100_000))
    def done_unread(self, data: st.DataObject, dt: int) -> None:
        """A slow reader: its window fills, then upstream finishes."""
        rid = self.pick(data, self.headers - self.ended)
        if rid is None:
            return
        self.model.window_full(rid, self.now)
        self.feed("window_full", rid, expect={})
        self.advance(dt)
        if rid in self.model.live:
            self.finish(rid)

    @rule(data=st.data(), kind=st.sampled_from(["done", "client_gone", "tokens", "failed"]))
    def late_event(self, data: st.DataObject, kind: str) -> None:
        """An event for an ended request does nothing."""
        rid = self.pick(data, self.ended)
        if rid is not None:
            extra = {"tokens": [3], "failed": [502]}.get(kind, [])
            self.feed(kind, rid, *extra, expect={})

    @rule(dt=STEPS)
    def timer(self, dt: int) -> None:
        """The host's timer fires now, possibly before it is due."""
        self.advance(dt)
        self.fire()

    # ---- backends ----------------------------------------------------------------------------

    @rule(
        backend=st.integers(0, 2),
        kv_usage=st.one_of(
            st.none(), st.floats(0, 1), st.sampled_from([0.0, 0.5, 0.79, 0.8, 0.81, 0.95, 1.0])
        ),
        bump=st.sampled_from([0, 0, 0, 1, 2, -1, None]),  # -1: the counter reset; None: absent
        kv_blocks=st.one_of(st.none(), st.none(), st.sampled_from([0, 16, 64, 200])),
        lag=st.integers(0, 1_000_000),
        dt=STEPS,
    )
    def scrape_ok(
        self,
        backend: int,
        kv_usage: float | None,
        bump: int | None,
        kv_blocks: int | None,
        lag: int,
        dt: int,
    ) -> None:
        self.advance(dt)
        names = list(self.model.backends)
        name = names[backend % len(names)]
        total = None
        if bump is not None:
            total = self.preemptions[name] = 0 if bump < 0 else self.preemptions[name] + bump
        self.scrape(name, kv_usage, total, kv_blocks, lag)

    @rule(backend=st.integers(0, 2), reachable=st.booleans(), dt=STEPS)
    def scrape_failed(self, backend: int, reachable: bool, dt: int) -> None:
        self.advance(dt)
        names = list(self.model.backends)
        name = names[backend % len(names)]
        health = self.model.scrape_failed(name, reachable)
        self.feed("scrape_failed", name, expect={}, health=health, reachable=reachable)

    @rule(dt=STEPS)
    def drain(self, dt: int) -> None:
        """Only late in a run: the last steps then meet a draining runtime."""
        if self.steps < 30 or self.model.draining:
            return
        self.advance(dt)
        self.model.drain(self.now)
        self.feed("drain", expect={})

    # ---- the end -------------------------------------------------------------------------------

    def teardown(self) -> None:
        if self.rt is None or self.broken:
            return
        if self.run_out:
            self.advance(60_000_000)
        for _ in range(10_000):
            if not self.model.live:
                break
            self.leave(min(self.model.live))
        rt = self.rt
        left = (rt.live, rt.running, rt.queued, rt.kv_blocks_in_use)
        assert left == (0, 0, 0, 0), f"leak: (live, running, queued, KV blocks) = {left} at the end"
        never = sorted(self.arrived - self.ended)
        assert not never, f"requests that never ended: {never}"
        replay = Runtime(self.config)
        for (method, args, kwargs, now), want in zip(self.events, self.log, strict=True):
            got = [repr(a) for a in getattr(replay, method)(*args, now, **kwargs)]
            assert got == want, f"replay of {method}{args} at {now}: {got} != {want}"
        actions = sum(map(len, self.log))
        assert replay_trace(rt.take_trace()) == (len(self.events), actions)


def machine_for(
    configs: st.SearchStrategy[dict[str, Any]], max_running: dict[str, int] | None = None
) -> type[RuntimeMachine]:
    """The machine over `configs` (runtime configs, as `Settings.to_runtime()` writes them).

    Args:
        configs: the configs to explore (`st.just(config)` for one).
        max_running: the user's own invariants: tenant -> most requests running at once.
    """
    return type(
        "RuntimeMachine",
        (RuntimeMachine,),
        {"configs": configs, "max_running": dict(max_running or {}), "last": None},
    )
