//! One model pool's queue: its tiers in strict order, each tier's backlogged tenants ordered
//! by (lane, VTC counter), each tenant's requests by their place.

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::FxHashMap;

use super::{Place, QueuedItem};
use crate::config::Strategy;

/// A backlogged tenant's key in its tier: (its head is late, the VTC counter's bits or, for
/// FIFO, the head's place). Non-negative floats order like their bit patterns.
type BacklogKey = (bool, u64, u64);

#[derive(Debug, Clone, Default)]
pub(super) struct TierQueue {
    /// Backlogged tenants by (ordering key, tenant index).
    pub(super) backlog: BTreeSet<(BacklogKey, u32)>,
    pub(super) len: usize,
    /// Requests in the late lane.
    pub(super) late: usize,
    pub(super) prompt_tokens: u64,
    /// Counter of the tenant served last: the lift for a tenant arriving to an idle tier.
    pub(super) last_served: f64,
}

#[derive(Debug, Clone)]
pub(super) struct TenantQueue {
    pub(super) tier: usize,
    pub(super) weight: f64,
    pub(super) counter: f64,
    pub(super) service: f64,
    pub(super) items: BTreeMap<Place, QueuedItem>,
    pub(super) prompt_tokens: u64,
    /// Prompt tokens of its requests in the fresh lane.
    pub(super) fresh_prompt_tokens: u64,
    /// Its requests in the fresh lane.
    pub(super) fresh_len: usize,
    pub(super) key: Option<BacklogKey>,
}

/// One pool's queue: tiers in strict order, tenants fairly within.
#[derive(Debug, Clone)]
pub(super) struct PoolQueue {
    pub(super) strategy: Strategy,
    pub(super) tiers: Vec<TierQueue>,
    pub(super) tenants: Vec<TenantQueue>,
    pub(super) index: FxHashMap<u64, (u32, Place)>,
}

impl PoolQueue {
    pub(super) fn new(strategy: Strategy, tiers: usize, tenants: &[(usize, f64)]) -> Self {
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
                    fresh_len: 0,
                    key: None,
                })
                .collect(),
            index: FxHashMap::default(),
        }
    }

    pub(super) fn tier_len(&self, tier: usize) -> usize {
        self.tiers[tier].len
    }

    /// Prompt tokens waiting in one tier: the prefill work it will bring.
    pub(super) fn tier_prompt_tokens(&self, tier: usize) -> u64 {
        self.tiers[tier].prompt_tokens
    }

    #[cfg(test)]
    pub(super) fn counter(&self, tenant: u32) -> f64 {
        self.tenants[tenant as usize].counter
    }

    /// Weighted tokens charged to a tenant so far.
    pub(super) fn service(&self, tenant: u32) -> f64 {
        self.tenants[tenant as usize].service
    }

    pub(super) fn tenant_len(&self, tenant: u32) -> usize {
        self.tenants[tenant as usize].items.len()
    }

    pub(super) fn push(&mut self, tenant: u32, item: QueuedItem, place: Place) {
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
    pub(super) fn place(&mut self, tenant: u32, item: QueuedItem, place: Place) {
        let t = &mut self.tenants[tenant as usize];
        t.items.insert(place, item);
        t.prompt_tokens += item.prompt_tokens;
        if place.late {
            self.tiers[t.tier].late += 1;
        } else {
            t.fresh_prompt_tokens += item.prompt_tokens;
            t.fresh_len += 1;
        }
        self.index.insert(item.id, (tenant, place));
    }

    pub(super) fn lapse(&mut self, id: u64) -> bool {
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
        self.tenants[t].fresh_len -= 1;
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
    pub(super) fn arrive(&mut self, tenant: u32) {
        let t = tenant as usize;
        if self.strategy == Strategy::Fair && self.tenants[t].items.is_empty() {
            self.lift(t);
        }
    }

    /// A request of `tenant` started (from the queue or at once): its counter is the lift for
    /// a tenant that arrives when nobody waits.
    pub(super) fn served(&mut self, tenant: u32) {
        let t = &self.tenants[tenant as usize];
        self.tiers[t.tier].last_served = t.counter;
    }

    /// Take the next request of a tier: the oldest of the tenant with the smallest counter.
    pub(super) fn pop(&mut self, tier: usize) -> Option<(u32, QueuedItem)> {
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
    pub(super) fn peek(&self, tier: usize) -> Option<QueuedItem> {
        let &(_, tenant) = self.tiers[tier].backlog.first()?;
        self.tenants[tenant as usize]
            .items
            .first_key_value()
            .map(|(_, &item)| item)
    }

    /// The request at the back of a tenant's line, with its place: the latest-come of its
    /// late lane, else the newest of its fresh lane.
    pub(super) fn newest(&self, tenant: u32) -> Option<(Place, QueuedItem)> {
        self.tenants[tenant as usize]
            .items
            .last_key_value()
            .map(|(&place, &item)| (place, item))
    }

    /// Prompt tokens a tenant has waiting.
    pub(super) fn tenant_prompt_tokens(&self, tenant: u32) -> u64 {
        self.tenants[tenant as usize].prompt_tokens
    }

    pub(super) fn weight(&self, tenant: u32) -> f64 {
        self.tenants[tenant as usize].weight
    }

    /// Take a request out wherever it is (cancelled or expired while waiting).
    pub(super) fn remove(&mut self, id: u64) -> Option<(u32, QueuedItem)> {
        let (tenant, place) = self.index.remove(&id)?;
        let t = tenant as usize;
        let item = self.tenants[t].items.remove(&place)?;
        self.forget(t, item, place);
        self.rekey(t);
        Some((tenant, item))
    }

    /// Charge a tenant for service: `cost` weighted tokens, divided by its weight.
    pub(super) fn charge(&mut self, tenant: u32, cost: f64) {
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
    pub(super) fn charge_elsewhere(&mut self, tenant: u32, cost: f64) {
        let t = &mut self.tenants[tenant as usize];
        t.counter += cost / t.weight;
        if self.strategy == Strategy::Fair {
            self.rekey(tenant as usize);
        }
    }

    pub(super) fn forget(&mut self, t: usize, item: QueuedItem, place: Place) {
        let tenant = &mut self.tenants[t];
        tenant.prompt_tokens -= item.prompt_tokens;
        if !place.late {
            tenant.fresh_prompt_tokens -= item.prompt_tokens;
            tenant.fresh_len -= 1;
        }
        let tier = &mut self.tiers[tenant.tier];
        tier.len -= 1;
        tier.late -= usize::from(place.late);
        tier.prompt_tokens -= item.prompt_tokens;
    }

    /// VTC's counter lift for a tenant that becomes backlogged: to the smallest counter of a
    /// backlogged tenant (the first of each lane group holds its group's smallest).
    pub(super) fn lift(&mut self, t: usize) {
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
    pub(super) fn rekey(&mut self, t: usize) {
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
