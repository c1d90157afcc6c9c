//! Gateway replicas sharing backends: the slots other replicas hold, as their shared store
//! reports them, and a started request handed back when the store refused its slot lease.
//!
//! The store's I/O (Redis) is the host's; these are the events it feeds back. The governor's
//! view of a backend's free slots is its cap less its own running requests less
//! `elsewhere`, so each replica's decisions follow the global picture within one sync period.
//!
//! Slots would otherwise stick to the replica that frees them (it starts its next request
//! before the others hear the slot is free). So while other replicas have requests waiting, a
//! replica runs at most its share of each backend: the weight of the tenants it has waiting
//! over everyone's (`replica_share`), rounded so that the replicas' shares add up to the cap.

use super::{Governor, OwnedArrival, Signals};
use crate::error::{PolicyError, PolicyResult};
use crate::types::Outcome;

impl Governor {
    /// Record how many of `backend`'s slots other replicas hold now, the weight of the
    /// tenants other replicas have waiting, and the part of that weight on the replicas
    /// ordered before this one (the replicas agree on an order: the host sorts them by id).
    pub fn set_elsewhere(
        &mut self,
        backend: u32,
        held: u32,
        waiting: f64,
        waiting_before: f64,
    ) -> PolicyResult<()> {
        let b = self
            .backends
            .get_mut(backend as usize)
            .ok_or_else(|| PolicyError::UnknownBackend(backend.to_string()))?;
        let weight = |w: f64| if w.is_finite() { w.max(0.0) } else { 0.0 };
        b.elsewhere = held;
        b.waiting_elsewhere = weight(waiting);
        b.waiting_before = weight(waiting_before).min(b.waiting_elsewhere);
        Ok(())
    }

    /// How many backends there are.
    pub fn backend_count(&self) -> u32 {
        self.backends.len() as u32
    }

    /// A backend's hard cap (GPUs x `max_concurrency_per_gpu`): what a slot lease in the
    /// shared store is granted below.
    pub fn backend_cap(&self, backend: u32) -> u32 {
        self.backends[backend as usize].cap
    }

    /// The weight of the tenants with requests waiting here (what other replicas are told).
    pub fn waiting_weight(&self) -> f64 {
        (0..self.config.tenants.len() as u32)
            .filter(|&t| self.queue.tenant_len(t) > 0)
            .map(|t| self.queue.weight(t))
            .sum()
    }

    /// The most slots of backend `b` this replica may run while other replicas have requests
    /// waiting: its share by waiting weight (at least one); `None` when none wait elsewhere or
    /// none here.
    ///
    /// The replicas lay their weights end to end in their agreed order, and each takes the
    /// slots between its two boundaries, each boundary rounded to the nearest slot. The
    /// shares then add up to the cap exactly, each within one slot of its weighted share.
    /// Rounding each share up on its own gave more than the cap in all (2 + 2 + 3 of 6 for
    /// weights 1, 1, 2), and the replicas that freed slots first kept the surplus: the
    /// heaviest replica was held to a third where its share was a half.
    pub(super) fn replica_share(&self, b: usize) -> Option<u32> {
        let backend = &self.backends[b];
        let elsewhere = backend.waiting_elsewhere;
        if elsewhere <= 0.0 {
            return None;
        }
        let here = self.waiting_weight();
        if here <= 0.0 {
            return None;
        }
        let slots = backend.cap.min(backend.tpot_cap);
        Some(slots_between(slots, backend.waiting_before, here, here + elsewhere).max(1))
    }

    /// Charge `tenant` the service (weighted tokens) other replicas gave it since the last
    /// sync, so this replica's fair order counts it (the Virtual Token Counter, shared).
    pub fn charge_elsewhere(&mut self, tenant: u32, cost: f64) -> PolicyResult<()> {
        if tenant as usize >= self.config.tenants.len() {
            return Err(PolicyError::UnknownTenant(tenant.to_string()));
        }
        if cost.is_finite() && cost > 0.0 {
            self.queue.charge_elsewhere(tenant, cost);
        }
        Ok(())
    }

    /// A started request whose slot lease the store refused: the slot was taken elsewhere
    /// since the last sync, so count one more held elsewhere (until the next sync says
    /// otherwise), end the start without charging it as served, and return what `submit`
    /// needs to decide it again (tenant, prompt, max tokens, its route: model pool, block
    /// hashes and fingerprint, and its client's signals). `None`: not running.
    pub fn lease_denied(&mut self, id: u64, now_us: u64) -> Option<OwnedArrival> {
        let req = self.requests.get_mut(&id)?;
        let backend = req.running.as_ref()?.backend as usize;
        let shape = OwnedArrival {
            tenant: req.tenant,
            prompt: req.prompt,
            max_tokens: req.max_tokens,
            pool: req.pool,
            chain: std::mem::take(&mut req.chain),
            fingerprint: req.fingerprint,
            // Decided again now, its client's deadline is what is left of it (none left:
            // the shortest the config honours, which refuses it unless it starts at once).
            signals: Signals {
                retries: req.retries,
                deadline_us: req.client_deadline_us.map(|at| at.saturating_sub(now_us)),
            },
        };
        let b = &mut self.backends[backend];
        b.elsewhere = b.elsewhere.saturating_add(1).min(b.cap);
        self.finish(id, Outcome::Cancelled, now_us);
        Some(shape)
    }
}

/// The slots of `slots` between the rounded boundaries `before` and `before + here` of
/// weights laid end to end over `total` (see `Governor::replica_share`).
fn slots_between(slots: u32, before: f64, here: f64, total: f64) -> u32 {
    let boundary = |weight: f64| (f64::from(slots) * weight / total + 0.5).floor();
    (boundary(before + here) - boundary(before)).max(0.0) as u32
}

#[cfg(test)]
mod tests {
    use super::super::tests::{governor, tenant};
    use super::slots_between;
    use crate::governor::Arrival;
    use crate::types::Decision;

    // Whatever the weights, the replicas' shares add up to the cap, and each is within one
    // slot of its weighted share: 1, 1, 2 of 6 gives 2 + 1 + 3 or the like (rounding each up
    // gave 2 + 2 + 3, past the cap).
    #[test]
    fn shares_add_up_to_the_cap() {
        let mut seed = 7_u64;
        let mut next = move || {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            (seed >> 33) as f64 / f64::from(1_u32 << 31)
        };
        for slots in [1, 2, 6, 7, 256] {
            for replicas in 1..=5 {
                let weights: Vec<f64> = (0..replicas).map(|_| (next() * 8.0).round()).collect();
                let total: f64 = weights.iter().sum();
                if total == 0.0 {
                    continue;
                }
                let mut before = 0.0;
                let mut sum = 0;
                for &w in &weights {
                    let share = slots_between(slots, before, w, total);
                    let exact = f64::from(slots) * w / total;
                    assert!(
                        (f64::from(share) - exact).abs() < 1.0,
                        "{weights:?} {slots}"
                    );
                    sum += share;
                    before += w;
                }
                assert_eq!(sum, slots, "{weights:?}");
            }
        }
        assert_eq!(
            [0.0, 1.0, 2.0].map(|before| slots_between(6, before, 1.0, 4.0)),
            [2, 1, 2]
        );
        assert_eq!(slots_between(6, 2.0, 2.0, 4.0), 3);
    }

    // Slots held elsewhere are not free here: a request queues behind them and starts when
    // the store says they came back.
    #[test]
    fn elsewhere_takes_slots() {
        let mut g = governor();
        let a = tenant(&g, "a");
        let cap = g.backends[0].cap;
        g.set_elsewhere(0, cap, 0.0, 0.0).unwrap();
        let d = g.submit(1, Arrival::new(a, 10, 10), 0).unwrap();
        assert!(matches!(d, Decision::Queued { .. }), "{d:?}");
        g.set_elsewhere(0, cap - 1, 0.0, 0.0).unwrap();
        let started = g.dispatch(1);
        assert_eq!(started.len(), 1);
        assert!(g.set_elsewhere(9, 0, 0.0, 0.0).is_err());
    }

    // Service given elsewhere moves a tenant behind one that got none: the other goes first.
    #[test]
    fn elsewhere_service_orders_the_queue() {
        let mut g = governor();
        let (a, b) = (tenant(&g, "a"), tenant(&g, "b"));
        for id in 1..=2 {
            g.submit(id, Arrival::new(a, 10, 10), 0).unwrap(); // both slots
        }
        g.submit(3, Arrival::new(a, 10, 10), 0).unwrap();
        g.submit(4, Arrival::new(b, 10, 10), 0).unwrap();
        g.charge_elsewhere(b, 1e6).unwrap();
        g.finish(1, crate::types::Outcome::Completed, 1);
        let next: Vec<u64> = g.dispatch(1).iter().map(|x| x.request_id).collect();
        assert_eq!(next, vec![3]);
        assert!(g.charge_elsewhere(99, 1.0).is_err());
    }

    // While another replica has a tenant waiting, this one runs at most its share by waiting
    // weight; with nothing waiting elsewhere it may use every free slot again.
    #[test]
    fn waiting_elsewhere_caps_this_replica() {
        let mut g = governor();
        let a = tenant(&g, "a");
        for id in 1..=2 {
            g.submit(id, Arrival::new(a, 10, 10), 0).unwrap(); // both slots
        }
        g.submit(3, Arrival::new(a, 10, 10), 0).unwrap(); // a waits here (weight 1)
        g.set_elsewhere(0, 0, 3.0, 0.0).unwrap(); // weight 3 waits elsewhere: our share is 1 slot
        assert_eq!(g.replica_share(0), Some(1));
        g.finish(1, crate::types::Outcome::Completed, 1);
        assert!(g.dispatch(1).is_empty()); // one still runs: that is our share
        g.set_elsewhere(0, 0, 0.0, 0.0).unwrap();
        assert_eq!(g.dispatch(2).len(), 1);
    }

    // A denied lease frees the local slot, counts one more elsewhere, and hands back the
    // request's shape; a request not running is left alone.
    #[test]
    fn denied_lease_frees_and_counts() {
        let mut g = governor();
        let a = tenant(&g, "a");
        g.submit(1, Arrival::new(a, 10, 20), 0).unwrap();
        assert_eq!(g.running(), 1);
        let back = g.lease_denied(1, 5).unwrap();
        assert_eq!(back.arrival(), Arrival::new(a, 10, 20));
        assert_eq!((g.running(), g.live(), g.backends[0].elsewhere), (0, 0, 1));
        assert_eq!(g.lease_denied(1, 6), None);
    }
}
