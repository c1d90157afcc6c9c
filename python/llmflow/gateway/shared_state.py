"""Slots shared by gateway replicas through Redis: the I/O the runtime's lease rule needs.

With `state: {backend: redis}` every replica's runtime still decides alone, the slot leases
included (`rust/src/runtime/lease.rs`); this module carries its `Lease` and `Release`
actions to Redis (`redis_store.RedisStore`, the `llmflow.store.LeaseStore` protocol) and feeds
back what Redis said, as events:

- **Leases.** A `Lease` action becomes one Lua script that purges expired leases and adds ours
  (a member of the sorted set `{prefix}:slots:{backend}` whose score is its expiry) only
  while fewer than the cap the runtime passed are live, so the cap holds across replicas
  atomically. The answer is fed back: `lease_granted` (the runtime then says `Start`),
  `lease_denied`, or `lease_failed` when Redis could not answer. A `Release` removes the
  lease. A replica killed with its leases loses them within `lease_ttl_ms`, to nobody's
  action.
- **The global picture.** Every `sync_interval_ms` one script per backend renews the leases
  the runtime says this replica holds (`Runtime.leases_held`), purges expired ones and counts
  the rest, fed as `Runtime.store_synced`: the runtime takes its own off the count.
- **Fair split between replicas.** Each sync also publishes the weight of the tenants this
  replica has waiting (`{prefix}:waiting`, expiring after three syncs) and reads the others'
  sum, and the part of it on replicas whose ids sort before ours; both go with
  `store_synced`, and while others wait the core runs at most its share of each backend by
  that weight (the order lets the core round the shares so they add up to the cap), so slots
  do not stick to the replica that frees them.
- **Fair order.** Each sync also adds this replica's per-tenant service (the weighted tokens
  its fair queue charged) to the hash `{prefix}:service` and reads everyone's back; what other
  replicas gave each tenant since the last sync is fed as `Runtime.shared_service`, so the
  Virtual Token Counter orders this replica's queue by each tenant's service everywhere.
- **Rate limits.** Each sync also adds what this replica let each tenant use (requests and
  tokens) to `{prefix}:used-requests` / `{prefix}:used-tokens`; what the others let it use
  since the last sync is fed as `Runtime.shared_usage`, and its buckets pay for it. So every
  replica enforces the tenant's whole limit on the tenant's whole use, one sync late: in `T`
  seconds a tenant gets at most its limit's `T` seconds, one bucket per replica, and what each
  replica admits in one sync period.
- **Loss of Redis.** A failed call is fed as `store_lost` (`lease_failed` for a lease): what
  the runtime then does (`on_loss`) is its own rule. The next sync that succeeds renews what
  the runtime still holds and feeds the true count.

Times in the scripts are Redis's own clock (`TIME`), so replicas' clocks need not agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import socket
from typing import TYPE_CHECKING, Any

from llmflow.gateway.redis_store import RedisStore
from llmflow.store import lease_name

if TYPE_CHECKING:
    from collections.abc import Callable

    from llmflow._core import Lease, Release
    from llmflow.config import Settings
    from llmflow.gateway.host import Host
    from llmflow.store import LeaseStore

__all__ = ["SharedSlots"]

log = logging.getLogger("llmflow.gateway")

# KEYS: the replicas' expiry set and their weights; ARGV: replica, its waiting weight, ttl ms.
# Records ours, forgets replicas that stopped syncing, returns the others' summed weight and
# the part of it on replicas whose ids sort before ours (the order every replica agrees on).
# A field that is not a finite weight >= 0 is deleted: one bad record never fails a sync.
_WAITING = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
for _, r in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do
  redis.call('HDEL', KEYS[2], r)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
local sum, before = 0, 0
local all = redis.call('HGETALL', KEYS[2])
for i = 1, #all, 2 do
  local w = tonumber(all[i + 1])
  if w == nil or w ~= w or w < 0 or w == math.huge then
    redis.call('HDEL', KEYS[2], all[i])  -- not a weight (a stray write): purged, not summed
  elseif all[i] ~= ARGV[1] then
    sum = sum + w
    if all[i] < ARGV[1] then before = before + w end
  end
end
return {tostring(sum), tostring(before)}
"""


class SharedSlots:
    """This replica's side of the shared state: the runtime's leases carried to Redis, and
    the sync.

    Args:
        settings: the config (its `state` section names Redis).
        host: the runtime's host, fed what Redis answered.
    """

    def __init__(self, settings: Settings, host: Host) -> None:
        try:
            import redis.asyncio as aioredis
        except ImportError:
            raise RuntimeError(
                "state.backend redis needs the redis package: pip install 'llmflow[redis]'"
            ) from None

        state = settings.state
        assert state.url is not None, "validated: state.backend redis needs a url"
        self.host = host
        self.state = state
        # Redis I/O bounds, not request rules: a call that hangs counts as the store lost.
        io_s = max(state.lease_ttl_ms / 3e3, 0.05)
        self.client = aioredis.from_url(state.url, socket_timeout=io_s, socket_connect_timeout=io_s)
        self.store: LeaseStore = RedisStore(self.client, state.key_prefix, state.lease_ttl_ms)
        # Host and pid name the replica for a person; the random part keeps two replicas apart
        # that share both (containers are all pid 1, and a copied pod can share a hostname),
        # whose leases and waiting weights would otherwise count as one replica's.
        self.replica = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.tenants = [t.name for t in settings.tenants]
        if settings.anonymous_tenant not in self.tenants:
            self.tenants.append(settings.anonymous_tenant)
        # The host's runtime is read at each sync (the app may replace it after this is made).
        self.totals = {  # per-tenant counters shared through one hash each
            "service": _Totals(
                f"{state.key_prefix}:service",
                self.tenants,
                lambda t: self.host.runtime.tenant_service(t),
            ),
            "requests": _Totals(
                f"{state.key_prefix}:used-requests",
                self.tenants,
                lambda t: self.host.runtime.tenant_usage(t)[0],
            ),
            "tokens": _Totals(
                f"{state.key_prefix}:used-tokens",
                self.tenants,
                lambda t: self.host.runtime.tenant_usage(t)[1],
            ),
        }
        self.lost = False  # for the log: the runtime keeps its own account
        self._waiting = self.client.register_script(_WAITING)
        self.waiting_keys = [f"{state.key_prefix}:waiting", f"{state.key_prefix}:waiting-weight"]
        self._task: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[Any]] = set()

    # ---- the runtime's lease actions ---------------------------------------------------------

    def lease(self, action: Lease) -> None:
        """Ask Redis for the lease; feed back its answer."""
        self._spawn(self._lease(action))

    async def _lease(self, action: Lease) -> None:
        rid = action.request_id
        try:
            granted = await self.store.acquire(
                action.backend, lease_name(self.replica, rid), action.cap
            )
        except Exception as exc:  # redis-py raises its own kinds and OSErrors
            self._warn(exc)
            self.host.lease_failed(rid)
            return
        if granted:
            self.host.lease_granted(rid)
        else:
            self.host.lease_denied(rid)

    def release(self, action: Release) -> None:
        """Give the lease back."""
        self._spawn(self._release(action.backend, [lease_name(self.replica, action.request_id)]))

    async def _release(self, backend: str, leases: list[str]) -> None:
        try:
            await self.store.release(backend, leases)
        except Exception as exc:  # it expires within the TTL anyway
            self._lose(exc)

    # ---- the sync ----------------------------------------------------------------------------

    def begin(self, tasks: set[asyncio.Task[Any]]) -> None:
        """Start the sync loop."""
        self._task = asyncio.create_task(self._run(), name="llmflow-shared-slots")
        tasks.add(self._task)
        self._task.add_done_callback(tasks.discard)

    async def _run(self) -> None:
        while True:
            await self.sync()
            await asyncio.sleep(self.state.sync_interval_ms / 1e3)

    async def sync(self) -> None:
        """Renew our leases, count everyone's, feed the runtime the counts and the rest."""
        try:
            counts = {}
            for backend, _ in self.host.runtime.leases_held():
                # What is held now, just before the call: a lease the runtime released since
                # the loop began must not be renewed (re-added) behind its release.
                ids = dict(self.host.runtime.leases_held())[backend]
                leases = [lease_name(self.replica, rid) for rid in ids]
                counts[backend] = await self.store.renew(backend, leases)
            async with self.client.pipeline(transaction=False) as pipe:
                for totals in self.totals.values():
                    totals.publish(pipe)
                # A command refused for its record (a field that is not a number) comes back
                # as that reply's error, for `_Totals.read` to contain; a lost connection raises.
                replies = await pipe.execute(raise_on_error=False)
            elsewhere = {name: totals.read(replies) for name, totals in self.totals.items()}
            ttl = int(3 * self.state.sync_interval_ms) + 1
            weight = self.host.runtime.waiting_weight
            waiting, before = map(
                float,
                await self._waiting(keys=self.waiting_keys, args=[self.replica, weight, ttl]),
            )
        except Exception as exc:
            self._lose(exc)
            return
        if self.lost:
            log.warning("shared state: Redis back at %s", self.state.url)
            self.lost = False
        for backend, live in counts.items():
            self.host.store_synced(backend, live, waiting, before)
        for tenant, cost in elsewhere["service"].items():
            self.host.shared_service(tenant, cost)
        for tenant in self.tenants:
            requests = elsewhere["requests"].get(tenant, 0.0)
            tokens = elsewhere["tokens"].get(tenant, 0.0)
            if requests > 0 or tokens > 0:
                self.host.shared_usage(tenant, requests, tokens)

    def _warn(self, exc: BaseException) -> None:
        if not self.lost:
            log.warning("shared state: Redis lost (%s: %s)", type(exc).__name__, exc)
        self.lost = True

    def _lose(self, exc: BaseException) -> None:
        self._warn(exc)
        self.host.store_lost()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def close(self) -> None:
        """Stop syncing, give back what we hold, close the connection."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._pending:
            await asyncio.wait(list(self._pending), timeout=1.0)
        with contextlib.suppress(Exception):
            for backend, ids in self.host.runtime.leases_held():
                await self.store.release(backend, [lease_name(self.replica, i) for i in ids])
        await self.client.aclose()


class _Totals:
    """One per-tenant counter shared through a Redis hash: each replica adds what it counted
    since its last sync and reads everyone's totals; what the others added since this
    replica's last read is theirs. The first read sets the baseline (what came before does
    not count), and a total that went down (a restarted Redis) counts nothing.

    A field that is not a finite number >= 0 (a stray write, another program's key) is read
    as absent and deleted at the next sync, and a key that is not a hash is deleted: one bad
    record costs that record, never the sync (which would mark Redis lost for the fleet).
    """

    def __init__(self, key: str, tenants: list[str], count: Callable[[str], float]) -> None:
        self.key, self.tenants, self.count = key, tenants, count
        self._published = dict.fromkeys(tenants, 0.0)  # ours, as last added
        self._mine: dict[str, float] = {}  # ours added in the pending exchange
        self._seen: dict[str, float] | None = None  # everyone's, as last read
        self._at = -1  # this counter's reply in the pipeline
        self._added: dict[str, int] = {}  # tenant -> its HINCRBYFLOAT's reply in the pipeline
        self._bad: set[bytes] = set()  # fields to delete at the next sync
        self._bad_key = False  # the key is not a hash: delete it at the next sync

    def publish(self, pipe: Any) -> None:
        """Queue our increments and the read of everyone's totals on `pipe`."""
        if self._bad_key:
            pipe.delete(self.key)
        elif self._bad:
            pipe.hdel(self.key, *self._bad)
        self._bad, self._bad_key = set(), False
        self._mine, self._added = {}, {}
        for tenant in self.tenants:
            delta = self.count(tenant) - self._published[tenant]
            self._mine[tenant] = delta
            if delta > 0:
                pipe.hincrbyfloat(self.key, tenant, delta)
                self._added[tenant] = len(pipe.command_stack) - 1
        pipe.hgetall(self.key)
        self._at = len(pipe.command_stack) - 1

    def read(self, replies: list[Any]) -> dict[str, float]:
        """What other replicas added for each tenant since the last read."""
        for tenant, delta in self._mine.items():
            at = self._added.get(tenant)
            if at is not None and isinstance(replies[at], Exception):
                self._mine[tenant] = 0.0  # not added (the field held garbage): next time
                self._bad.add(tenant.encode())
            else:
                self._published[tenant] += delta
        reply = replies[self._at]
        if isinstance(reply, Exception):  # WRONGTYPE: the key is not ours to read
            log.warning("shared state: %s is not a hash (%s): deleting it", self.key, reply)
            self._bad_key = True
            return {}
        everyone: dict[str, float] = {}
        for field, raw in reply.items():
            value = _count(raw)
            if value is None:
                log.warning("shared state: %s[%r] = %.40r is not a count: deleting it",
                            self.key, field, raw)  # fmt: skip
                self._bad.add(field)
            else:
                everyone[field.decode("utf-8", "replace")] = value
        seen, self._seen = self._seen, everyone
        if seen is None:
            return {}
        out = {}
        for tenant in self.tenants:
            total, before = everyone.get(tenant, 0.0), seen.get(tenant, 0.0)
            elsewhere = total - before - self._mine.get(tenant, 0.0)
            if elsewhere > 0 and total >= before:
                out[tenant] = elsewhere
        return out


def _count(raw: Any) -> float | None:
    """A hash field's value as a finite count >= 0, or None."""
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) and value >= 0 else None
