"""The shared store's slot leases, as plain I/O: what a replica's runtime asks of Redis.

The rule (when to ask, below which cap, what a refusal or a lost store means, when to give a
lease back, which leases each sync renews, what the store's count says about the other
replicas) is the core runtime's (`rust/src/runtime/lease.rs`): it answers with `Lease` and
`Release` actions and is fed `lease_granted` / `lease_denied` / `lease_failed` /
`store_lost` / `store_synced`. A store only carries the calls out. Two implement this
protocol: Redis (`gateway/shared_state.py`, each call one atomic Lua script) and the
simulator's Redis (`sim/replicas.py`, in memory). A lease is named by the replica and the
request (`lease_name`), and expires `ttl` after it was last granted or renewed, by the
store's own clock.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["LeaseStore", "lease_name"]


def lease_name(replica: str, request_id: int) -> str:
    """The store's name for a replica's lease of one request."""
    return f"{replica}:{request_id}"


class LeaseStore(Protocol):
    """The lease calls a shared store answers, each atomic at the store."""

    async def acquire(self, backend: str, lease: str, cap: int) -> bool:
        """Purge the backend's expired leases, then add `lease` only while fewer than `cap`
        are live.

        Returns:
            Whether the lease was granted.

        Raises:
            Exception: the store could not be reached (the caller feeds `lease_failed`).
        """
        ...

    async def renew(self, backend: str, leases: list[str]) -> int:
        """Renew (or re-add, after the store lost them) `leases`, purge the expired ones.

        Returns:
            How many leases are live on the backend, `leases` among them.
        """
        ...

    async def release(self, backend: str, leases: list[str]) -> None:
        """Give `leases` back."""
        ...
