//! The waiting queue: strict order between tiers, weighted fairness between tenants in a tier.
//!
//! Fairness is the Virtual Token Counter of Sheng et al., "Fairness in Serving Large Language
//! Models" (OSDI 2024): each tenant has a counter of the service it received (weighted tokens,
//! divided by its weight); the backlogged tenant with the smallest counter goes next. A tenant
//! that becomes backlogged has its counter lifted to the smallest backlogged counter, so idling
//! earns no credit to starve the others later. Cost is counted in tokens (and KV, via the
//! charges the admission controller makes), so one tenant's 1,500 long requests cannot starve
//! another's short ones. Inside one tenant, requests keep arrival order.
//!
//! Each tier has two lanes. A request that can still meet its first-token SLA waits in the
//! *fresh* lane; one that cannot any more (it waited past the SLA, or it is a client's retry of
//! a request refused longer ago than that) moves to the *late* lane (`lapse`), behind every
//! fresh request of its tier, in the order its client first came. Under an overload that no
//! order keeps on time, serving the late first only makes the fresh late too (the brownout
//! scenario served 205 requests on time this way against vLLM's 283); serving the fresh first
//! keeps them on time, and the late, whose SLA is lost either way, are served oldest first as
//! soon as the fresh leave room (as in Facebook's adaptive LIFO, "Fail at Scale", 2015, with
//! the late kept in order rather than dropped). Between tenants, a tenant whose next request is
//! fresh goes before one whose next is late; VTC orders each group.
//!
//! Every operation is O(log n): tenants are kept in a `BTreeSet` keyed by (lane, counter), a
//! tenant's requests in a `BTreeMap` keyed by (lane, arrival number).
//!
//! Requests for different models wait in separate pools (one `PoolQueue` per model pool, each
//! with its own tier order and tenant counters), so a request that waits for model A's busy
//! backends never stands in front of one for model B, whose backends may be idle: dispatch
//! takes each pool's head on its own, still O(log n), instead of scanning past entries whose
//! pool has no room. Queries by tier or tenant add the pools up (there are few).

use rustc_hash::FxHashMap;

use crate::config::Strategy;
use pool::PoolQueue;

#[derive(Debug, Clone, Copy)]
pub struct QueuedItem {
    pub id: u64,
    pub prompt_tokens: u64,
}

/// Where a request waits inside its tenant's line: its lane, then the µs its client first
/// came (a retry keeps the place of its first attempt), then its arrival number
/// (`FairQueue::push_to`): first come, first served in each lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Place {
    late: bool,
    since: u64,
    seq: u64,
}

/// The waiting requests of all pools.
#[derive(Debug, Clone)]
pub struct FairQueue {
    strategy: Strategy,
    pools: Vec<PoolQueue>,
    /// Request id -> its pool.
    pool_of: FxHashMap<u64, u32>,
    /// Arrival number across pools, so "newest of a tenant" compares pools.
    next_seq: u64,
}

impl FairQueue {
    /// One pool; `tenants` gives each tenant's (tier index, weight).
    pub fn new(strategy: Strategy, tiers: usize, tenants: &[(usize, f64)]) -> Self {
        Self::pooled(strategy, tiers, tenants, 1)
    }

    /// `pools` independent queues of the same tiers and tenants.
    pub fn pooled(
        strategy: Strategy,
        tiers: usize,
        tenants: &[(usize, f64)],
        pools: usize,
    ) -> Self {
        Self {
            strategy,
            pools: (0..pools.max(1))
                .map(|_| PoolQueue::new(strategy, tiers, tenants))
                .collect(),
            pool_of: FxHashMap::default(),
            next_seq: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.pool_of.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pool_of.is_empty()
    }

    pub fn contains(&self, id: u64) -> bool {
        self.pool_of.contains_key(&id)
    }

    /// The pool a queued request waits in.
    pub fn pool_of(&self, id: u64) -> Option<u32> {
        self.pool_of.get(&id).copied()
    }

    /// Waiting requests of a tier, over all pools.
    pub fn tier_len(&self, tier: usize) -> usize {
        self.pools.iter().map(|p| p.tier_len(tier)).sum()
    }

    /// Waiting requests of a tier in one pool.
    pub fn pool_tier_len(&self, pool: u32, tier: usize) -> usize {
        self.pools[pool as usize].tier_len(tier)
    }

    /// Waiting requests of a tier's fresh lane in one pool: those a fresh newcomer waits behind.
    pub fn pool_tier_fresh_len(&self, pool: u32, tier: usize) -> usize {
        let tq = &self.pools[pool as usize].tiers[tier];
        tq.len - tq.late
    }

    /// Whether a queued request waits in the late lane.
    pub fn is_late(&self, id: u64) -> bool {
        self.pool_of(id).is_some_and(|pool| {
            self.pools[pool as usize]
                .index
                .get(&id)
                .is_some_and(|&(_, place)| place.late)
        })
    }

    /// Prompt tokens waiting in one tier: the prefill work it will bring.
    pub fn tier_prompt_tokens(&self, tier: usize) -> u64 {
        self.pools.iter().map(|p| p.tier_prompt_tokens(tier)).sum()
    }

    /// A tenant's fairness counter in the first pool (tests).
    #[cfg(test)]
    pub fn counter(&self, tenant: u32) -> f64 {
        self.pools[0].counter(tenant)
    }

    /// Weighted tokens charged to a tenant so far, over all pools.
    pub fn service(&self, tenant: u32) -> f64 {
        self.pools.iter().map(|p| p.service(tenant)).sum()
    }

    pub fn tenant_len(&self, tenant: u32) -> usize {
        self.pools.iter().map(|p| p.tenant_len(tenant)).sum()
    }

    /// Queue a request at the back of its tenant's line in the first pool.
    #[cfg(test)]
    pub fn push(&mut self, tenant: u32, item: QueuedItem) {
        let since = self.next_seq; // tests: arrival numbers stand for times
        self.push_to(0, tenant, item, since, false);
    }

    /// Queue a request in its tenant's line in a pool, in the fresh or the `late` lane, by
    /// `since_us`, the µs its client first came (now, but for a retry), then by arrival.
    pub fn push_to(&mut self, pool: u32, tenant: u32, item: QueuedItem, since_us: u64, late: bool) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.pool_of.insert(item.id, pool);
        let place = Place {
            late,
            since: since_us,
            seq,
        };
        self.pools[pool as usize].push(tenant, item, place);
    }

    /// Move a queued request of the fresh lane to the late lane, keeping its order. False when
    /// it is not queued or already late.
    pub fn lapse(&mut self, id: u64) -> bool {
        let Some(&pool) = self.pool_of.get(&id) else {
            return false;
        };
        self.pools[pool as usize].lapse(id)
    }

    /// Take the next request of a tier in the first pool.
    #[cfg(test)]
    pub fn pop(&mut self, tier: usize) -> Option<(u32, QueuedItem)> {
        self.pop_from(0, tier)
    }

    /// Take the next request of a tier in a pool: the oldest of the tenant with the smallest
    /// counter.
    pub fn pop_from(&mut self, pool: u32, tier: usize) -> Option<(u32, QueuedItem)> {
        let popped = self.pools[pool as usize].pop(tier)?;
        self.pool_of.remove(&popped.1.id);
        Some(popped)
    }

    /// The request `pop` would take next in the first pool, without taking it.
    #[cfg(test)]
    pub fn peek(&self, tier: usize) -> Option<QueuedItem> {
        self.peek_in(0, tier)
    }

    /// The request `pop_from` would take next, without taking it.
    pub fn peek_in(&self, pool: u32, tier: usize) -> Option<QueuedItem> {
        self.pools[pool as usize].peek(tier)
    }

    /// The most recently queued request of a tenant, in any pool (the one to push out first).
    pub fn newest(&self, tenant: u32) -> Option<QueuedItem> {
        self.pools
            .iter()
            .filter_map(|p| p.newest(tenant))
            .max_by_key(|&(place, _)| place)
            .map(|(_, item)| item)
    }

    /// Prompt tokens waiting in one tier of one pool (a per-pool TTFT estimate's work ahead).
    pub fn pool_tier_prompt_tokens(&self, pool: u32, tier: usize) -> u64 {
        self.pools[pool as usize].tier_prompt_tokens(tier)
    }

    /// Prompt tokens a tenant has waiting in one pool.
    pub fn pool_tenant_prompt_tokens(&self, pool: u32, tenant: u32) -> u64 {
        self.pools[pool as usize].tenant_prompt_tokens(tenant)
    }

    /// Prompt tokens a tenant has waiting in one pool's fresh lane.
    pub fn pool_tenant_fresh_prompt_tokens(&self, pool: u32, tenant: u32) -> u64 {
        self.pools[pool as usize].tenants[tenant as usize].fresh_prompt_tokens
    }

    /// Requests a tenant has waiting in one pool's fresh lane.
    pub fn pool_tenant_fresh_len(&self, pool: u32, tenant: u32) -> usize {
        self.pools[pool as usize].tenants[tenant as usize].fresh_len
    }

    /// Prompt tokens a tenant has waiting, over all pools.
    pub fn tenant_prompt_tokens(&self, tenant: u32) -> u64 {
        self.pools
            .iter()
            .map(|p| p.tenant_prompt_tokens(tenant))
            .sum()
    }

    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    pub fn weight(&self, tenant: u32) -> f64 {
        self.pools[0].weight(tenant)
    }

    /// Take a request out wherever it is (cancelled or expired while waiting).
    pub fn remove(&mut self, id: u64) -> Option<(u32, QueuedItem)> {
        let pool = self.pool_of.remove(&id)?;
        self.pools[pool as usize].remove(id)
    }

    /// VTC's arrival rule in the first pool (tests).
    #[cfg(test)]
    pub fn arrive(&mut self, tenant: u32) {
        self.arrive_in(0, tenant);
    }

    /// VTC's arrival rule, in the request's pool: see `PoolQueue::arrive`.
    pub fn arrive_in(&mut self, pool: u32, tenant: u32) {
        self.pools[pool as usize].arrive(tenant);
    }

    /// A start in the first pool (tests).
    #[cfg(test)]
    pub fn served(&mut self, tenant: u32) {
        self.served_in(0, tenant);
    }

    /// A request of `tenant` started in `pool`: see `PoolQueue::served`.
    pub fn served_in(&mut self, pool: u32, tenant: u32) {
        self.pools[pool as usize].served(tenant);
    }

    /// Service a tenant received from other gateway replicas (see `PoolQueue::charge_elsewhere`),
    /// raised in every pool: the replicas share one counter per tenant, not one per model.
    pub fn charge_elsewhere(&mut self, tenant: u32, cost: f64) {
        for pool in &mut self.pools {
            pool.charge_elsewhere(tenant, cost);
        }
    }

    /// Charge a tenant for service in the first pool.
    #[cfg(test)]
    pub fn charge(&mut self, tenant: u32, cost: f64) {
        self.charge_in(0, tenant, cost);
    }

    /// Charge a tenant for service in a pool: `cost` weighted tokens, divided by its weight.
    /// Fairness is kept per pool: service on model A earns no priority on model B.
    pub fn charge_in(&mut self, pool: u32, tenant: u32, cost: f64) {
        self.pools[pool as usize].charge(tenant, cost);
    }
}

mod pool;

#[cfg(test)]
mod tests;
