//! What a client says of its request (`Signals`: its retry count and its deadline, read by the
//! host from headers an SDK or proxy already sends), as the governor honours it: bounded by the
//! config's `signals` section, and the deadline weighed against the wait expected in the queue.
//! The retry count's use, when the client first came, is `Governor::seen` in `mod.rs`.

use super::{Arrival, Governor, Signals};
use crate::config::Strategy;
use crate::governor::us;

impl Governor {
    /// What a request's client said, as the config lets it count: a retry count above
    /// `signals.max_retries` is not honoured, a deadline below `signals.min_deadline_ms` is
    /// raised to it, and either is dropped where the config turns it off.
    pub(super) fn honoured(&self, signals: Signals) -> Signals {
        let bounds = &self.config.signals;
        Signals {
            retries: signals
                .retries
                .filter(|&n| bounds.retries && n <= bounds.max_retries),
            deadline_us: signals
                .deadline_us
                .filter(|_| bounds.deadlines)
                .map(|d| d.max(us(Some(bounds.min_deadline_ms)).unwrap_or(0))),
        }
    }

    /// Seconds by which a request's expected wait in the queue (those expected ahead of it,
    /// `expected_ahead`, drained at `drain`) would overshoot its client's deadline: its client
    /// would have given up before it starts, so it is refused now (told when the wait will be
    /// within its budget) rather than started for nobody.
    pub(super) fn deadline_excess(
        &self,
        arrival: Arrival<'_>,
        late: bool,
        drain: f64,
    ) -> Option<f64> {
        let budget_s = self.honoured(arrival.signals).deadline_us? as f64 / 1e6;
        let tier_idx = self.tenant_tier[arrival.tenant as usize];
        let ahead = self.expected_ahead(arrival.tenant, tier_idx, arrival.route.pool, late);
        let wait_s = (ahead + 1) as f64 / drain;
        (wait_s >= budget_s).then_some(wait_s - budget_s)
    }

    /// Queued requests a newcomer of this tenant is expected to wait behind, in its pool: all
    /// of more important tiers; in its own tier, its tenant's own fresh requests and, under
    /// fair order, from each other tenant at most the weighted share that tenant gets served
    /// meanwhile (as `sla_excess` counts prompt tokens); in FIFO order, every fresh one. A late
    /// newcomer waits behind its whole tier. (The queue position `decide` reports counts every
    /// fresh request of the tier, which overstates a light tenant's wait under fair order.)
    pub(super) fn expected_ahead(
        &self,
        tenant: u32,
        tier_idx: usize,
        pool: u32,
        late: bool,
    ) -> usize {
        let q = &self.queue;
        let higher: usize = (0..tier_idx).map(|t| q.pool_tier_len(pool, t)).sum();
        if late || q.strategy() != Strategy::Fair {
            let own_tier = if late {
                q.pool_tier_len(pool, tier_idx)
            } else {
                q.pool_tier_fresh_len(pool, tier_idx)
            };
            return higher + own_tier;
        }
        let own = q.pool_tenant_fresh_len(pool, tenant);
        let served = (own + 1) as f64 / q.weight(tenant);
        let others: usize = self.tier_tenants[tier_idx]
            .iter()
            .filter(|&&t| t != tenant)
            .map(|&t| {
                q.pool_tenant_fresh_len(pool, t)
                    .min((served * q.weight(t)) as usize)
            })
            .sum();
        higher + own + others
    }
}
