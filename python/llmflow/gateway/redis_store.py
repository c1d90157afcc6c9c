"""Slot leases in Redis: the `llmflow.store.LeaseStore` protocol, each call one Lua script.

Plain I/O for the runtime's lease rule (`rust/src/runtime/lease.rs`): the acquire script is a
compare-and-increment against the cap the runtime passed, the renew script re-adds and counts,
a release is a `ZREM`. Each backend's leases are the sorted set `{prefix}:slots:{backend}`,
lease name -> expiry, in Redis's own clock (`TIME`), so replicas' clocks need not agree.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RedisStore"]

# KEYS[1] the backend's set; ARGV: lease id, ttl ms, the cap the runtime passed, then the
# leases this replica gave back whose removal may not have reached Redis yet (removed first).
# 1: leased, 0: the cap is reached (a compare-and-increment: the cap is not this script's to
# compute).
_ACQUIRE = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
for i = 4, #ARGV do redis.call('ZREM', KEYS[1], ARGV[i]) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], 10 * tonumber(ARGV[2]))
return 1
"""

# KEYS[1] the backend's set; ARGV: ttl ms, then our live lease ids. Renews (or re-adds, after
# Redis lost them) ours, purges the expired, and returns how many are live in all.
_SYNC = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local expiry = now + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], expiry, ARGV[i]) end
if #ARGV > 1 then redis.call('PEXPIRE', KEYS[1], 10 * tonumber(ARGV[1])) end
return redis.call('ZCARD', KEYS[1])
"""


class RedisStore:
    """Slot leases in Redis (the `LeaseStore` protocol): each call one atomic Lua script.

    Args:
        client: the `redis.asyncio` client.
        key_prefix: the prefix of the backends' lease sets.
        ttl_ms: how long a lease lives after it was granted or last renewed.
    """

    def __init__(self, client: Any, key_prefix: str, ttl_ms: float) -> None:
        self.client, self.prefix, self.ttl_ms = client, key_prefix, int(ttl_ms)
        self._acquire = client.register_script(_ACQUIRE)
        self._sync = client.register_script(_SYNC)
        # Leases given back whose ZREM is still on its way: calls go out on the pool's several
        # connections, so an acquire issued after a release can reach Redis first and find the
        # slot still taken; it removes these itself.
        self._releasing: dict[str, set[str]] = {}

    def _key(self, backend: str) -> str:
        return f"{self.prefix}:slots:{backend}"

    async def acquire(self, backend: str, lease: str, cap: int) -> bool:
        """Add `lease` while fewer than `cap` are live; whether it was."""
        gone = sorted(self._releasing.get(backend, ()))
        args = [lease, self.ttl_ms, cap, *gone]
        return bool(await self._acquire(keys=[self._key(backend)], args=args))

    async def renew(self, backend: str, leases: list[str]) -> int:
        """Renew `leases`; how many are live on the backend."""
        return int(await self._sync(keys=[self._key(backend)], args=[self.ttl_ms, *leases]))

    async def release(self, backend: str, leases: list[str]) -> None:
        """Give `leases` back."""
        if not leases:
            return
        releasing = self._releasing.setdefault(backend, set())
        releasing.update(leases)
        try:
            await self.client.zrem(self._key(backend), *leases)
        finally:
            releasing.difference_update(leases)
