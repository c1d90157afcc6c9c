"""Random interleavings of the request lifecycle against the reference model.

Covers: running <= cap per backend; queue <= max_waiting; every decision matches the reference;
each request ends exactly once; the KV ledger equals the sum over live requests and is zero
when idle; VIP is never shed while normal would be let in; every rejection has a positive
Retry-After; the same event sequence always gives the same decisions.
"""

from __future__ import annotations

import copy
from typing import Any

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
from property_tests.models import ReferenceGovernor, Req

OUTCOMES = ("completed", "error", "cancelled")


class GovernorMachine(RuleBasedStateMachine):
    """Drives `llmflow._core.Governor` and `ReferenceGovernor` through the same events."""

    ids = Bundle("ids")

    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.next_id = 1
        self.log: list[tuple[str, tuple[Any, ...], Any]] = []

    @initialize(config=s.configs)
    def build(self, config: dict[str, Any]) -> None:
        self.config = config
        self.core = Governor(config)
        self.model = ReferenceGovernor(config)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        result = getattr(self.core, method)(*args, **kwargs)
        self.log.append((method, (*args, tuple(sorted(kwargs.items()))), _plain(result)))
        return result

    @rule(
        target=ids,
        tenant=s.tenants,
        prompt=s.prompt_tokens,
        max_tokens=s.max_tokens,
        dt=s.time_steps_us,
    )
    def submit(self, tenant: str, prompt: int, max_tokens: int, dt: int) -> int:
        self.now += dt
        self.expire_both()
        expected = self.model.expected(tenant)
        placeable = self.model.placeable(self.model.tenant_tier[tenant])
        if tenant == "v1" and expected[0] == "rejected":
            self.check_vip_not_shed_before_normal()
        rid = self.next_id
        self.next_id += 1
        victim = self.model.victim(tenant) if expected[1] == "displaces" else None
        decision = self.call("submit", rid, tenant, prompt, max_tokens, self.now)
        # submit dispatches the request it queues: one that can start comes back admitted,
        # and the others it starts come out of the next dispatch.
        handed = self.call("dispatch", self.now) if not isinstance(decision, Rejected) else []
        tier = self.model.tenant_tier[tenant]
        match decision:
            case Rejected(reason=reason, retry_after_s=retry):
                assert ("rejected", reason) == expected, (decision, expected)
                assert retry > 0
            case Queued(displaced=displaced, displaced_retry_after_s=retry):
                assert expected[0] == "queued", (decision, expected)
                if displaced is None:
                    # Nobody is pushed out when the dispatch made room.
                    assert victim is None or handed, (decision, victim)
                else:
                    assert displaced == victim, (decision, victim)
                    assert retry is not None
                    assert retry > 0
                    del self.model.live[victim]
                self.model.live[rid] = Req(tenant, tier, prompt)
            case Admitted(backend=backend):
                assert expected[0] in ("admitted", "queued"), (decision, expected)
                assert backend in placeable
                self.model.live[rid] = Req(tenant, tier, prompt, backend=backend)
        self.take(handed)
        return rid

    @rule(target=ids, tenant=s.tenants, count=st.integers(2, 8), prompt=s.prompt_tokens)
    def burst(self, tenant: str, count: int, prompt: int) -> Any:
        """Many requests of one tenant at once: fills queues and provokes displacement."""
        return multiple(*(self.submit(tenant, prompt, 64, 0) for _ in range(count)))

    def check_vip_not_shed_before_normal(self) -> None:
        for normal in ("n1", "n2"):
            probe = copy.copy(self.core).submit(10**9, normal, 1, 1, self.now)
            assert isinstance(probe, Rejected), f"VIP refused while {normal} gets in: {probe}"

    @rule()
    def dispatch(self) -> None:
        self.take(self.call("dispatch", self.now))

    def take(self, admissions: list[Any]) -> None:
        """Check admissions against the model (in tier order, as the core makes them)."""
        for admission in sorted(admissions, key=lambda a: self.model.live[a.request_id].tier):
            req = self.model.live[admission.request_id]
            assert req.backend is None, "dispatched a request that was not queued"
            assert admission.backend in self.model.placeable(req.tier)
            higher = [t for t in range(req.tier) if self.model.queued_in(t)]
            assert not any(self.model.placeable(t) for t in higher), "skipped a higher tier"
            req.backend = admission.backend

    @rule(rid=ids, n=st.integers(0, 40), dt=s.time_steps_us)
    def tokens(self, rid: int, n: int, dt: int) -> None:
        self.now += dt // 10
        self.call("on_tokens", rid, n, self.now)
        req = self.model.live.get(rid)
        if req is not None and req.backend is not None:
            req.generated += n

    @rule(rid=ids)
    def first_token(self, rid: int) -> None:
        self.call("on_first_token", rid, self.now)

    @rule(rid=consumes(ids), outcome=st.sampled_from(OUTCOMES))
    def finish(self, rid: int, outcome: str) -> None:
        was_live = rid in self.model.live
        assert self.call("finish", rid, outcome, self.now) == was_live
        self.model.live.pop(rid, None)
        assert self.call("finish", rid, outcome, self.now) is False, "ended twice"

    @rule(dt=s.time_steps_us)
    def advance(self, dt: int) -> None:
        self.now += dt * 4
        self.expire_both()

    def expire_both(self) -> None:
        for expired in self.call("expire", self.now):
            req = self.model.live.pop(expired.request_id)
            assert expired.was_running == (req.backend is not None)

    @rule(backend=st.integers(0, 1), usage=st.floats(0, 1), preemptions=st.integers(0, 3))
    def observe(self, backend: int, usage: float, preemptions: int) -> None:
        name = f"b{backend}"
        if name in self.model.caps:
            self.call(
                "observe_backend", name, self.now, kv_usage=usage, preemptions_total=preemptions
            )
            self.model.kv_usage[name] = usage

    @rule(backend=st.integers(0, 1), healthy=st.booleans())
    def health(self, backend: int, healthy: bool) -> None:
        name = f"b{backend}"
        if name in self.model.caps:
            self.call("set_backend_health", name, healthy)
            self.model.healthy[name] = healthy

    @precondition(lambda self: self.now > 0)
    @rule()
    def drain(self) -> None:
        self.call("start_draining")
        self.model.draining = True

    @invariant()
    def agrees_with_model(self) -> None:
        if not hasattr(self, "core"):
            return
        snap = self.core.snapshot(self.now)
        for b in snap["backends"]:
            assert b["running"] <= b["cap"]
            assert b["running"] == self.model.running_on(b["name"])
        assert snap["queued"] == self.model.queued <= self.config["max_waiting"]
        assert self.core.live == len(self.model.live)
        assert self.core.kv_blocks_in_use == self.model.ledger()
        for r in snap["requests"]:
            req = self.model.live[r["id"]]
            assert r["kv_blocks"] == (self.model.blocks(req) if req.backend else 0)
        if not self.model.live:
            assert (self.core.kv_blocks_in_use, self.core.running, self.core.queued) == (0, 0, 0)

    def teardown(self) -> None:
        if not hasattr(self, "core"):
            return
        replay = Governor(self.config)
        for method, args, result in self.log:
            *positional, kwargs = args
            assert _plain(getattr(replay, method)(*positional, **dict(kwargs))) == result


def _plain(value: Any) -> Any:
    """A comparable form of a core result (decisions, admissions and lists of them)."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if type(value).__module__ == "llmflow._core":
        fields = sorted(name for name in dir(value) if not name.startswith("_"))
        return (type(value).__name__, *(getattr(value, name) for name in fields))
    return value


TestGovernorMachine = GovernorMachine.TestCase
