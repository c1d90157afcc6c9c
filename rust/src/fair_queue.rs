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

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::FxHashMap;

use crate::config::Strategy;

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

/// A backlogged tenant's key in its tier: (its head is late, the VTC counter's bits or, for
/// FIFO, the head's place). Non-negative floats order like their bit patterns.
type BacklogKey = (bool, u64, u64);

#[derive(Debug, Clone, Default)]
struct TierQueue {
    /// Backlogged tenants by (ordering key, tenant index).
    backlog: BTreeSet<(BacklogKey, u32)>,
    len: usize,
    /// Requests in the late lane.
    late: usize,
    prompt_tokens: u64,
    /// Counter of the tenant served last: the lift for a tenant arriving to an idle tier.
    last_served: f64,
}

#[derive(Debug, Clone)]
struct TenantQueue {
    tier: usize,
    weight: f64,
    counter: f64,
    service: f64,
    items: BTreeMap<Place, QueuedItem>,
    prompt_tokens: u64,
    /// Prompt tokens of its requests in the fresh lane.
    fresh_prompt_tokens: u64,
    key: Option<BacklogKey>,
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

/// One pool's queue: tiers in strict order, tenants fairly within.
#[derive(Debug, Clone)]
struct PoolQueue {
    strategy: Strategy,
    tiers: Vec<TierQueue>,
    tenants: Vec<TenantQueue>,
    index: FxHashMap<u64, (u32, Place)>,
}

impl PoolQueue {
    fn new(strategy: Strategy, tiers: usize, tenants: &[(usize, f64)]) -> Self {
        Self {
            strategy,
            tiers: vec![TierQueue::default(); tiers],
            tenants: tenants
                .iter()
                .map(|&(tier, weight)| TenantQueue {
                    tier,
                    weight,
                    counter: 0.0,
                    service: 0.0,
                    items: BTreeMap::new(),
                    prompt_tokens: 0,
                    fresh_prompt_tokens: 0,
                    key: None,
                })
                .collect(),
            index: FxHashMap::default(),
        }
    }

    fn tier_len(&self, tier: usize) -> usize {
        self.tiers[tier].len
    }

    /// Prompt tokens waiting in one tier: the prefill work it will bring.
    fn tier_prompt_tokens(&self, tier: usize) -> u64 {
        self.tiers[tier].prompt_tokens
    }

    #[cfg(test)]
    fn counter(&self, tenant: u32) -> f64 {
        self.tenants[tenant as usize].counter
    }

    /// Weighted tokens charged to a tenant so far.
    fn service(&self, tenant: u32) -> f64 {
        self.tenants[tenant as usize].service
    }

    fn tenant_len(&self, tenant: u32) -> usize {
        self.tenants[tenant as usize].items.len()
    }

    fn push(&mut self, tenant: u32, item: QueuedItem, place: Place) {
        let t = tenant as usize;
        if self.tenants[t].items.is_empty() {
            self.lift(t);
        }
        self.place(tenant, item, place);
        let tier = &mut self.tiers[self.tenants[t].tier];
        tier.len += 1;
        tier.prompt_tokens += item.prompt_tokens;
        self.rekey(t);
    }

    /// Put an item in its tenant's line at `place` (the tier's length is the caller's).
    fn place(&mut self, tenant: u32, item: QueuedItem, place: Place) {
        let t = &mut self.tenants[tenant as usize];
        t.items.insert(place, item);
        t.prompt_tokens += item.prompt_tokens;
        if place.late {
            self.tiers[t.tier].late += 1;
        } else {
            t.fresh_prompt_tokens += item.prompt_tokens;
        }
        self.index.insert(item.id, (tenant, place));
    }

    fn lapse(&mut self, id: u64) -> bool {
        let Some(&(tenant, place)) = self.index.get(&id) else {
            return false;
        };
        if place.late {
            return false;
        }
        let t = tenant as usize;
        let item = self.tenants[t].items.remove(&place).expect("indexed");
        self.tenants[t].prompt_tokens -= item.prompt_tokens;
        self.tenants[t].fresh_prompt_tokens -= item.prompt_tokens;
        let late = Place {
            late: true,
            ..place
        };
        self.place(tenant, item, late);
        self.rekey(t);
        true
    }

    /// VTC's arrival rule: a tenant that has nothing waiting is lifted to the smallest
    /// backlogged counter of its tier, or, when nobody waits, to the counter of the tenant its
    /// tier served last. Applied to every arrival, not only to one that queues: a tenant whose
    /// first request of a burst starts at once must not keep the credit of its idle time, or
    /// it takes every freed slot until its counter catches up with tenants that were served
    /// all along (the burst scenario starved its steady tenant for 7 s this way).
    fn arrive(&mut self, tenant: u32) {
        let t = tenant as usize;
        if self.strategy == Strategy::Fair && self.tenants[t].items.is_empty() {
            self.lift(t);
        }
    }

    /// A request of `tenant` started (from the queue or at once): its counter is the lift for
    /// a tenant that arrives when nobody waits.
    fn served(&mut self, tenant: u32) {
        let t = &self.tenants[tenant as usize];
        self.tiers[t.tier].last_served = t.counter;
    }

    /// Take the next request of a tier: the oldest of the tenant with the smallest counter.
    fn pop(&mut self, tier: usize) -> Option<(u32, QueuedItem)> {
        let &(_, tenant) = self.tiers[tier].backlog.first()?;
        let t = tenant as usize;
        let (place, item) = self.tenants[t].items.pop_first()?;
        self.index.remove(&item.id);
        self.forget(t, item, place);
        self.tiers[tier].last_served = self.tenants[t].counter;
        self.rekey(t);
        Some((tenant, item))
    }

    /// The request `pop` would take next, without taking it.
    fn peek(&self, tier: usize) -> Option<QueuedItem> {
        let &(_, tenant) = self.tiers[tier].backlog.first()?;
        self.tenants[tenant as usize]
            .items
            .first_key_value()
            .map(|(_, &item)| item)
    }

    /// The request at the back of a tenant's line, with its place: the latest-come of its
    /// late lane, else the newest of its fresh lane.
    fn newest(&self, tenant: u32) -> Option<(Place, QueuedItem)> {
        self.tenants[tenant as usize]
            .items
            .last_key_value()
            .map(|(&place, &item)| (place, item))
    }

    /// Prompt tokens a tenant has waiting.
    fn tenant_prompt_tokens(&self, tenant: u32) -> u64 {
        self.tenants[tenant as usize].prompt_tokens
    }

    fn weight(&self, tenant: u32) -> f64 {
        self.tenants[tenant as usize].weight
    }

    /// Take a request out wherever it is (cancelled or expired while waiting).
    fn remove(&mut self, id: u64) -> Option<(u32, QueuedItem)> {
        let (tenant, place) = self.index.remove(&id)?;
        let t = tenant as usize;
        let item = self.tenants[t].items.remove(&place)?;
        self.forget(t, item, place);
        self.rekey(t);
        Some((tenant, item))
    }

    /// Charge a tenant for service: `cost` weighted tokens, divided by its weight.
    fn charge(&mut self, tenant: u32, cost: f64) {
        let t = &mut self.tenants[tenant as usize];
        t.service += cost;
        t.counter += cost / t.weight;
        if self.strategy == Strategy::Fair {
            self.rekey(tenant as usize);
        }
    }

    /// Raise a tenant's counter by service it received from other gateway replicas (`cost`
    /// weighted tokens): the order between tenants then counts their service everywhere,
    /// while `service` stays what this queue charged.
    fn charge_elsewhere(&mut self, tenant: u32, cost: f64) {
        let t = &mut self.tenants[tenant as usize];
        t.counter += cost / t.weight;
        if self.strategy == Strategy::Fair {
            self.rekey(tenant as usize);
        }
    }

    fn forget(&mut self, t: usize, item: QueuedItem, place: Place) {
        let tenant = &mut self.tenants[t];
        tenant.prompt_tokens -= item.prompt_tokens;
        if !place.late {
            tenant.fresh_prompt_tokens -= item.prompt_tokens;
        }
        let tier = &mut self.tiers[tenant.tier];
        tier.len -= 1;
        tier.late -= usize::from(place.late);
        tier.prompt_tokens -= item.prompt_tokens;
    }

    /// VTC's counter lift for a tenant that becomes backlogged: to the smallest counter of a
    /// backlogged tenant (the first of each lane group holds its group's smallest).
    fn lift(&mut self, t: usize) {
        let tier = &self.tiers[self.tenants[t].tier];
        let fresh = tier.backlog.first();
        let late = tier.backlog.range(((true, 0, 0), 0)..).next();
        let floor = [fresh, late]
            .into_iter()
            .flatten()
            .map(|&(_, other)| self.tenants[other as usize].counter)
            .reduce(f64::min)
            .unwrap_or(tier.last_served);
        let tenant = &mut self.tenants[t];
        tenant.counter = tenant.counter.max(floor);
    }

    /// Put the tenant at the right place in its tier's backlog (or take it out when empty).
    fn rekey(&mut self, t: usize) {
        let tenant = &self.tenants[t];
        let new_key = tenant
            .items
            .first_key_value()
            .map(|(&place, _)| match self.strategy {
                Strategy::Fair => (place.late, tenant.counter.to_bits(), 0),
                Strategy::Fifo => (place.late, place.since, place.seq),
            });
        if new_key == tenant.key {
            return;
        }
        let backlog = &mut self.tiers[tenant.tier].backlog;
        if let Some(old) = tenant.key {
            backlog.remove(&(old, t as u32));
        }
        if let Some(new) = new_key {
            backlog.insert((new, t as u32));
        }
        self.tenants[t].key = new_key;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(id: u64) -> QueuedItem {
        QueuedItem {
            id,
            prompt_tokens: 10,
        }
    }

    // Two tenants of one tier alternate when each service costs the same.
    #[test]
    fn equal_tenants_alternate() {
        let mut q = FairQueue::new(Strategy::Fair, 1, &[(0, 1.0), (0, 1.0)]);
        for id in 0..4 {
            q.push(0, item(id));
        }
        for id in 10..14 {
            q.push(1, item(id));
        }
        let mut order = vec![];
        while let Some((tenant, it)) = q.pop(0) {
            q.charge(tenant, 100.0);
            order.push(it.id);
        }
        assert_eq!(order, vec![0, 10, 1, 11, 2, 12, 3, 13]);
    }

    // A tenant of weight 2 is served twice as often as one of weight 1.
    #[test]
    fn weights_share_service() {
        let mut q = FairQueue::new(Strategy::Fair, 1, &[(0, 2.0), (0, 1.0)]);
        for id in 0..6 {
            q.push(0, item(id));
            q.push(1, item(100 + id));
        }
        let mut heavy = 0;
        for _ in 0..6 {
            let (tenant, _) = q.pop(0).unwrap();
            q.charge(tenant, 10.0);
            heavy += usize::from(tenant == 0);
        }
        assert_eq!(heavy, 4);
    }

    // A tenant that was idle is lifted to the backlogged minimum, earning no credit for idling.
    #[test]
    fn lift_on_new_backlog() {
        let mut q = FairQueue::new(Strategy::Fair, 1, &[(0, 1.0), (0, 1.0)]);
        q.push(0, item(1));
        q.charge(0, 1000.0);
        q.push(0, item(2));
        q.push(1, item(3));
        assert!((q.counter(1) - 1000.0).abs() < 1e-9);
    }

    // A tenant served at once (never queued) still sets the lift: a newcomer that starts its
    // burst while nobody waits is lifted to it instead of keeping its idle credit.
    #[test]
    fn lift_after_direct_service() {
        let mut q = FairQueue::new(Strategy::Fair, 1, &[(0, 1.0), (0, 1.0)]);
        q.arrive(0);
        q.served(0);
        q.charge(0, 1000.0);
        q.arrive(0);
        q.served(0);
        q.arrive(1);
        assert!((q.counter(1) - 1000.0).abs() < 1e-9);
        q.push(1, item(1));
        q.push(0, item(2));
        assert_eq!(
            q.pop(0).map(|(t, _)| t),
            Some(0),
            "equal counters: lower index first"
        );
    }

    // FIFO keeps arrival order across tenants of a tier.
    #[test]
    fn fifo_is_arrival_order() {
        let mut q = FairQueue::new(Strategy::Fifo, 1, &[(0, 1.0), (0, 1.0)]);
        q.push(0, item(1));
        q.push(0, item(2));
        q.push(1, item(3));
        q.charge(0, 1e9);
        let order: Vec<u64> = std::iter::from_fn(|| q.pop(0).map(|(_, i)| i.id)).collect();
        assert_eq!(order, vec![1, 2, 3]);
    }

    // A pool's waiting head never blocks another pool's: each pops on its own, and queries by
    // tier and tenant add the pools up; the newest of a tenant is compared across pools.
    #[test]
    fn pools_are_independent() {
        let mut q = FairQueue::pooled(Strategy::Fair, 1, &[(0, 1.0)], 2);
        q.push_to(0, 0, item(1), 0, false);
        q.push_to(1, 0, item(2), 1, false);
        q.push_to(0, 0, item(3), 2, false);
        assert_eq!(
            (q.tier_len(0), q.pool_tier_len(1, 0), q.tenant_len(0)),
            (3, 1, 3)
        );
        assert_eq!(q.newest(0).map(|i| i.id), Some(3));
        assert_eq!(q.pop_from(1, 0).map(|(_, i)| i.id), Some(2));
        assert!(q.pop_from(1, 0).is_none());
        assert_eq!(q.remove(1).map(|(_, i)| i.id), Some(1));
        assert_eq!((q.len(), q.pool_of(3)), (1, Some(0)));
        assert_eq!(
            (
                q.pool_tier_prompt_tokens(0, 0),
                q.pool_tenant_prompt_tokens(1, 0)
            ),
            (10, 0)
        );
    }

    // Removing from the middle keeps counts and prompt totals right.
    #[test]
    fn remove_anywhere() {
        let mut q = FairQueue::new(Strategy::Fair, 2, &[(0, 1.0), (1, 1.0)]);
        q.push(0, item(1));
        q.push(0, item(2));
        q.push(1, item(3));
        assert_eq!(q.remove(2).map(|(_, i)| i.id), Some(2));
        assert!(q.remove(2).is_none());
        assert_eq!(
            (q.len(), q.tier_len(0), q.tier_prompt_tokens(0)),
            (2, 1, 10)
        );
        assert_eq!(q.pop(0).map(|(_, i)| i.id), Some(1));
        assert!(q.pop(0).is_none());
        assert_eq!(q.pop(1).map(|(_, i)| i.id), Some(3));
        assert!(q.is_empty());
    }

    // The late lane: behind every fresh request of the tier, whatever the tenants' counters,
    // in the order their clients first came; counts and prompt totals follow the moves.
    #[test]
    fn late_lane_yields_to_fresh() {
        for strategy in [Strategy::Fair, Strategy::Fifo] {
            let mut q = FairQueue::new(strategy, 1, &[(0, 1.0), (0, 1.0)]);
            q.push_to(0, 0, item(1), 900, false);
            q.push_to(0, 0, item(2), 950, false);
            q.push_to(0, 1, item(3), 500, true); // a retry whose client first came at 500
            q.push_to(0, 1, item(4), 990, false);
            q.push_to(0, 1, item(5), 400, false); // a retry, not late: ahead of its tenant's 4
            q.charge(1, 1.0e6); // tenant 1 far over its share: its fresh ones still go first
            assert!(q.lapse(1));
            assert!(!q.lapse(1) && q.is_late(1) && q.is_late(3) && !q.is_late(2));
            assert_eq!((q.pool_tier_fresh_len(0, 0), q.tier_len(0)), (3, 5));
            assert_eq!(
                (
                    q.pool_tenant_fresh_prompt_tokens(0, 0),
                    q.pool_tenant_prompt_tokens(0, 0)
                ),
                (10, 20)
            );
            // the back of tenant 0's line is now its late request
            assert_eq!(q.newest(0).map(|i| i.id), Some(1));
            let order: Vec<u64> = std::iter::from_fn(|| q.pop(0).map(|(_, i)| i.id)).collect();
            let want = match strategy {
                // fresh: tenant 0 (smaller counter), then 1's by first come; late: VTC again
                Strategy::Fair => vec![2, 5, 4, 1, 3],
                // fresh by first come (400, 950, 990); late by first come (500 before 900)
                Strategy::Fifo => vec![5, 2, 4, 3, 1],
            };
            assert_eq!(order, want, "{strategy:?}");
            assert_eq!(
                (q.pool_tier_fresh_len(0, 0), q.tier_prompt_tokens(0)),
                (0, 0)
            );
        }
    }
}
