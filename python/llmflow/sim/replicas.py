"""N gateway replicas sharing slot leases and fair-queue counters through a simulated Redis.

Each replica is a `GatedPolicy` (its own `Runtime`, scrapes and timer, built with
`lifecycle.leases` as the gateway's is with Redis) and the gateway's shared-state protocol
(`gateway/shared_state.py`) is replayed in simulated time: the runtime's `Lease` goes to the
simulated store (`SimRedis`, the same `llmflow.store.LeaseStore` protocol in memory) and its
answer comes back a round trip (`redis_rtt_ms`) later as `lease_granted` / `lease_denied`;
its `Release` reaches the store half a round trip later; every `sync_ms` each replica renews
the leases its runtime holds, counts everyone's and exchanges per-tenant service and waiting
weight (`store_synced`, `shared_service`). Every lease decision is the runtime's. Redis's
state changes at the instant a call reaches it (half the round trip). Arrivals go to replicas
round robin, or by tenant (`balance: by_tenant`: tenant i to replica i mod N, the uneven
spread that tests fairness). A replica may crash (`crash_at_s`): its requests fail, and its
leases hold their slots until `lease_ttl_ms` expires them.
`shared: false` runs the N replicas with no Redis at all, each on the whole cap.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, TypeVar

from llmflow._core import Lease, Release
from llmflow.config import State
from llmflow.sim.clients import ERROR
from llmflow.sim.policies import GatedPolicy
from llmflow.store import lease_name

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Generator

    import simpy

    from llmflow._core import Runtime
    from llmflow.config import Settings
    from llmflow.sim.clients import Attempt
    from llmflow.sim.cluster import Cluster
    from llmflow.sim.scenario import ReplicaSpec
    from llmflow.store import LeaseStore

__all__ = ["ReplicatedPolicy", "SimRedis"]

T = TypeVar("T")


# The per-tenant counters replicas share, as the gateway does (`gateway/shared_state.py`):
# fair-queue service, and the requests and tokens rate limits charged.
_COUNTERS: dict[str, Callable[[Runtime, str], float]] = {
    "service": lambda rt, t: rt.tenant_service(t),
    "requests": lambda rt, t: rt.tenant_usage(t)[0],
    "tokens": lambda rt, t: rt.tenant_usage(t)[1],
}


class SimRedis:
    """The leases (the `LeaseStore` protocol, in memory) and the per-tenant counter hashes
    (service, requests, tokens), as Redis holds them.

    Its calls answer at the instant they reach it (the caller's SimPy process waits the round
    trip): each coroutine completes without suspending, run by `at_once`.
    """

    def __init__(self, env: simpy.Environment, ttl_s: float) -> None:
        self.env, self.ttl_s = env, ttl_s
        self.leases: dict[str, dict[str, float]] = {}  # backend -> lease -> expiry (sim s)
        self.totals: dict[str, dict[str, float]] = {name: {} for name in _COUNTERS}
        self.waiting: dict[int, tuple[float, float]] = {}  # replica -> (weight, expiry)

    def _live(self, backend: str) -> dict[str, float]:
        leases = self.leases.setdefault(backend, {})
        for lease in [k for k, exp in leases.items() if exp <= self.env.now]:
            del leases[lease]
        return leases

    async def acquire(self, backend: str, lease: str, cap: int) -> bool:
        """The Lua script's compare-and-increment against the runtime's cap."""
        leases = self._live(backend)
        if len(leases) >= cap:
            return False
        leases[lease] = self.env.now + self.ttl_s
        return True

    async def renew(self, backend: str, leases: list[str]) -> int:
        """Renew `leases`; how many are live."""
        live = self._live(backend)
        for lease in leases:
            live[lease] = self.env.now + self.ttl_s
        return len(live)

    async def release(self, backend: str, leases: list[str]) -> None:
        """Give `leases` back."""
        for lease in leases:
            self.leases.get(backend, {}).pop(lease, None)

    def waiting_elsewhere(self, replica: int, weight: float, ttl_s: float) -> tuple[float, float]:
        """The other replicas' summed waiting weight, and the part of it on replicas numbered
        before `replica` (the order every replica agrees on, as the gateway's ids)."""
        self.waiting[replica] = (weight, self.env.now + ttl_s)
        live = [(r, w) for r, (w, exp) in self.waiting.items() if exp > self.env.now]
        others = sum(w for r, w in live if r != replica)
        return others, sum(w for r, w in live if r < replica)


def at_once(call: Coroutine[Any, Any, T]) -> T:
    """The answer of a `SimRedis` call, which never suspends."""
    try:
        call.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    call.close()
    raise RuntimeError("a simulated store call suspended")


class _Queued:
    """The replicas' queues together, for the runner's samples."""

    def __init__(self, replicas: list[GatedPolicy]) -> None:
        self.replicas = replicas

    @property
    def queued(self) -> int:
        return sum(r.runtime.queued for r in self.replicas)


class ReplicatedPolicy:
    """N gated replicas in front of one cluster (see the module doc).

    Args:
        env: the simulation environment.
        cluster: the backends.
        settings: every replica's llmflow config.
        spec: how many replicas and how they share state.
    """

    def __init__(
        self, env: simpy.Environment, cluster: Cluster, settings: Settings, spec: ReplicaSpec
    ) -> None:
        self.env, self.spec = env, spec
        if spec.shared:  # each runtime leases its slots, as the gateway's with Redis
            state = State(
                backend="redis",
                url="redis://simulated/0",
                on_loss=settings.state.on_loss,
                lease_ttl_ms=spec.lease_ttl_ms,
                sync_interval_ms=spec.sync_ms,
                replicas=spec.n,
            )
            settings = settings.model_copy(update={"state": state})
        self.replicas = [GatedPolicy(env, cluster, settings) for _ in range(spec.n)]
        for k, gp in enumerate(self.replicas):
            gp._ids = k * 1_000_000_000  # request ids are the engine's keys: apart per replica
        self.runtime = _Queued(self.replicas)
        self.redis = SimRedis(env, spec.lease_ttl_ms / 1e3)
        self.store: LeaseStore = self.redis
        self.routing = [t.name for t in settings.tenants]  # by_tenant: i-th tenant -> replica i
        self.tenants = [*self.routing, settings.anonymous_tenant]
        # per replica, per shared counter: ours as last added, and everyone's as last read
        self.published = [
            {name: dict.fromkeys(self.tenants, 0.0) for name in _COUNTERS} for _ in self.replicas
        ]
        self.seen: list[dict[str, dict[str, float]] | None] = [None for _ in self.replicas]
        self.owner: dict[int, tuple[int, Attempt]] = {}
        self.dead: set[int] = set()
        self.lease_denials = 0
        self._rr = itertools.count()
        if spec.shared:
            for k, gp in enumerate(self.replicas):
                self._wrap(k, gp)
                env.process(self._sync(k))
        if spec.crash_at_s is not None:
            env.process(self._crash_at(0, spec.crash_at_s))

    # ---- what the runner reads ---------------------------------------------------------------

    @property
    def peak_queue(self) -> int:
        return max(r.peak_queue for r in self.replicas)

    @property
    def rejections(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.replicas:
            for reason, n in r.rejections.items():
                out[reason] = out.get(reason, 0) + n
        return out

    @property
    def browned_out(self) -> int:
        return sum(r.browned_out for r in self.replicas)

    def flush_trace(self) -> None:
        """No trace: N runtimes do not make one replayable trace."""

    # ---- the client side ---------------------------------------------------------------------

    def send(self, att: Attempt) -> None:
        """The request arrives at the replica the load balancer picks."""
        live = [k for k in range(self.spec.n) if k not in self.dead]
        if self.spec.balance == "by_tenant":
            tenant = att.req.tenant
            idx = self.routing.index(tenant) if tenant in self.routing else 0
            k = live[idx % len(live)]
        else:
            k = live[next(self._rr) % len(live)]
        self.owner[id(att)] = (k, att)
        self.replicas[k].send(att)

    def cancel(self, att: Attempt) -> None:
        """Client disconnect, to the replica that has the request."""
        k, _ = self.owner.get(id(att), (None, att))
        if k is not None and k not in self.dead:
            self.replicas[k].cancel(att)

    # ---- the shared-state protocol -----------------------------------------------------------

    def _wrap(self, k: int, gp: GatedPolicy) -> None:
        """The runtime's lease actions go to the simulated store."""

        def lease(a: Lease) -> None:
            self.env.process(self._lease(k, gp, a))

        def release(a: Release) -> None:
            self.env.process(self._release(k, a))

        gp._do[Lease], gp._do[Release] = lease, release

    def _half(self) -> simpy.Event:
        return self.env.timeout(self.spec.redis_rtt_ms / 2e3)

    def _lease(self, k: int, gp: GatedPolicy, a: Lease) -> Generator[Any, Any, None]:
        yield self._half()
        if k in self.dead:
            return
        lease = lease_name(str(k), a.request_id)
        granted = at_once(self.store.acquire(a.backend, lease, a.cap))
        yield self._half()
        if k in self.dead:
            return
        if granted:
            gp._carry(gp.runtime.lease_granted(a.request_id, gp._now_us()))
        else:
            self.lease_denials += 1
            gp._carry(gp.runtime.lease_denied(a.request_id, gp._now_us()))

    def _release(self, k: int, a: Release) -> Generator[Any, Any, None]:
        yield self._half()
        at_once(self.store.release(a.backend, [lease_name(str(k), a.request_id)]))

    def _sync(self, k: int) -> Generator[Any, Any, None]:
        gp = self.replicas[k]
        while k not in self.dead:
            yield self.env.timeout(self.spec.sync_ms / 1e3)
            yield self._half()
            if k in self.dead:
                return
            counts = {
                backend: at_once(
                    self.store.renew(backend, [lease_name(str(k), rid) for rid in ids])
                )
                for backend, ids in gp.runtime.leases_held()
            }
            delta: dict[str, dict[str, float]] = {}
            for name, counter in _COUNTERS.items():
                delta[name] = {}
                for tenant in self.tenants:
                    d = counter(gp.runtime, tenant) - self.published[k][name][tenant]
                    delta[name][tenant] = d
                    self.published[k][name][tenant] += d
                    total = self.redis.totals[name]
                    total[tenant] = total.get(tenant, 0.0) + d
            everyone = {name: dict(total) for name, total in self.redis.totals.items()}
            waiting, before = self.redis.waiting_elsewhere(
                k, gp.runtime.waiting_weight, 3 * self.spec.sync_ms / 1e3
            )
            yield self._half()
            now = gp._now_us()
            for backend, live in counts.items():
                gp._carry(
                    gp.runtime.store_synced(
                        backend, live, now, waiting=waiting, waiting_before=before
                    )
                )
            seen, self.seen[k] = self.seen[k], everyone
            if seen is None:
                continue
            given = {
                name: {
                    t: everyone[name].get(t, 0.0) - seen[name].get(t, 0.0) - delta[name][t]
                    for t in self.tenants
                }
                for name in _COUNTERS
            }
            for tenant in self.tenants:
                if given["service"][tenant] > 0:
                    gp._carry(gp.runtime.shared_service(tenant, given["service"][tenant], now))
                requests = max(given["requests"][tenant], 0.0)
                tokens = max(given["tokens"][tenant], 0.0)
                if requests > 0 or tokens > 0:
                    gp._carry(gp.runtime.shared_usage(tenant, requests, tokens, now))

    def _crash_at(self, k: int, at_s: float) -> Generator[Any, Any, None]:
        yield self.env.timeout(at_s)
        self.dead.add(k)
        gp = self.replicas[k]
        gp._do = dict.fromkeys(gp._do, _gone)  # its runtime still ticks; nothing is carried out
        for rid, att in list(gp._atts.items()):
            up = gp._up.pop(rid, None)
            if up is not None:
                up.backend.abort(up.seq)
            gp._atts.pop(rid, None)
            att.end(ERROR, reason="replica_crashed")
        # its leases stay in the store until they expire


def _gone(_action: object) -> None:
    """A crashed replica's actions: nobody carries them out."""
