//! Gateway replicas sharing backends: the slots other replicas hold, as their shared store
//! reports them, and a started request handed back when the store refused its slot lease.
//!
//! The store's I/O (Redis) is the host's; these are the events it feeds back. The governor's
//! view of a backend's free slots is its cap less its own running requests less
//! `elsewhere`, so each replica's decisions follow the global picture within one sync period.

use super::Governor;
use crate::error::{PolicyError, PolicyResult};
use crate::types::Outcome;

impl Governor {
    /// Record how many of `backend`'s slots other replicas hold now.
    pub fn set_elsewhere(&mut self, backend: u32, held: u32) -> PolicyResult<()> {
        let b = self
            .backends
            .get_mut(backend as usize)
            .ok_or_else(|| PolicyError::UnknownBackend(backend.to_string()))?;
        b.elsewhere = held;
        Ok(())
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
    /// needs to decide it again (tenant, prompt, max tokens). `None`: not running.
    pub fn lease_denied(&mut self, id: u64, now_us: u64) -> Option<(u32, u64, u64)> {
        let req = self.requests.get(&id)?;
        let backend = req.running.as_ref()?.backend as usize;
        let shape = (req.tenant, req.prompt, req.max_tokens);
        let b = &mut self.backends[backend];
        b.elsewhere = b.elsewhere.saturating_add(1).min(b.cap);
        self.finish(id, Outcome::Cancelled, now_us);
        Some(shape)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{governor, tenant};
    use crate::types::Decision;

    // Slots held elsewhere are not free here: a request queues behind them and starts when
    // the store says they came back.
    #[test]
    fn elsewhere_takes_slots() {
        let mut g = governor();
        let a = tenant(&g, "a");
        let cap = g.backends[0].cap;
        g.set_elsewhere(0, cap).unwrap();
        let d = g.submit(1, a, 10, 10, 0).unwrap();
        assert!(matches!(d, Decision::Queued { .. }), "{d:?}");
        g.set_elsewhere(0, cap - 1).unwrap();
        let started = g.dispatch(1);
        assert_eq!(started.len(), 1);
        assert!(g.set_elsewhere(9, 0).is_err());
    }

    // Service given elsewhere moves a tenant behind one that got none: the other goes first.
    #[test]
    fn elsewhere_service_orders_the_queue() {
        let mut g = governor();
        let (a, b) = (tenant(&g, "a"), tenant(&g, "b"));
        for id in 1..=2 {
            g.submit(id, a, 10, 10, 0).unwrap(); // both slots
        }
        g.submit(3, a, 10, 10, 0).unwrap();
        g.submit(4, b, 10, 10, 0).unwrap();
        g.charge_elsewhere(b, 1e6).unwrap();
        g.finish(1, crate::types::Outcome::Completed, 1);
        let next: Vec<u64> = g.dispatch(1).iter().map(|x| x.request_id).collect();
        assert_eq!(next, vec![3]);
        assert!(g.charge_elsewhere(99, 1.0).is_err());
    }

    // A denied lease frees the local slot, counts one more elsewhere, and hands back the
    // request's shape; a request not running is left alone.
    #[test]
    fn denied_lease_frees_and_counts() {
        let mut g = governor();
        let a = tenant(&g, "a");
        g.submit(1, a, 10, 20, 0).unwrap();
        assert_eq!(g.running(), 1);
        assert_eq!(g.lease_denied(1, 5), Some((a, 10, 20)));
        assert_eq!((g.running(), g.live(), g.backends[0].elsewhere), (0, 0, 1));
        assert_eq!(g.lease_denied(1, 6), None);
    }
}
