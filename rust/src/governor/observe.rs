//! Backend observations: scrapes, KV capacity, health, draining, and the preemption breaker
//! they trip.

use super::{us, Governor};
use crate::backend::Observation;
use crate::error::{PolicyError, PolicyResult};

impl Governor {
    /// Feed a scrape of a backend's metrics. A rising preemption counter trips the breaker.
    pub fn observe_backend(
        &mut self,
        backend: u32,
        now_us: u64,
        kv_usage: Option<f64>,
        running: Option<u64>,
        waiting: Option<u64>,
        preemptions_total: Option<u64>,
    ) -> PolicyResult<()> {
        if let Some(v) = kv_usage {
            if !(0.0..=1.0 + 1e-9).contains(&v) {
                return Err(PolicyError::invalid(format!(
                    "kv_usage must be in 0..1, got {v}"
                )));
            }
        }
        let b = self
            .backends
            .get_mut(backend as usize)
            .ok_or_else(|| PolicyError::UnknownBackend(backend.to_string()))?;
        b.sample_prefill(now_us);
        if let Some(tpot) = b.sample_tpot(now_us) {
            if let Some(target) = self.config.tpot_target_ms {
                b.follow_tpot(tpot, target / 1000.0);
            }
        }
        b.observed = Some(Observation {
            kv_usage,
            running,
            waiting,
            at_us: now_us,
        });
        let mut tripped = false;
        if let Some(total) = preemptions_total {
            tripped = b.preemptions_seen.is_some_and(|seen| total > seen);
            if tripped {
                b.preemptions_total += total - b.preemptions_seen.unwrap_or(total);
            }
            b.preemptions_seen = Some(total);
        }
        self.tick(now_us);
        if tripped {
            if let Some(cooldown) = us(self.config.preemption_cooldown_ms) {
                self.breaker.trip(now_us, cooldown);
            }
        }
        Ok(())
    }

    pub fn set_kv_capacity(&mut self, backend: u32, blocks: u64) {
        self.backends[backend as usize].kv_capacity_blocks = blocks;
        if blocks > 0 {
            // The prefix memory holds about what the backend's cache can.
            self.prefix[backend as usize].set_capacity(blocks);
        }
    }

    pub fn set_backend_health(&mut self, backend: u32, healthy: bool) {
        self.backends[backend as usize].healthy = healthy;
    }

    /// Refuse new requests from now on (reason `draining`); live ones continue.
    pub fn start_draining(&mut self) {
        self.draining = true;
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{governor, tenant};
    use crate::governor::Arrival;
    use crate::types::{Decision, Outcome, RejectReason};

    // Draining refuses new work but lets live requests finish.
    #[test]
    fn draining() {
        let mut g = governor();
        let a = tenant(&g, "a");
        g.submit(1, Arrival::new(a, 10, 10), 0).unwrap();
        g.start_draining();
        let d = g.submit(2, Arrival::new(a, 10, 10), 0).unwrap();
        assert!(matches!(
            d,
            Decision::Rejected {
                reason: RejectReason::Draining,
                ..
            }
        ));
        assert!(g.finish(1, Outcome::Completed, 1));
    }

    // With every backend unhealthy new work is refused; health restored, it is admitted.
    #[test]
    fn health() {
        let mut g = governor();
        let a = tenant(&g, "a");
        g.set_backend_health(0, false);
        let d = g.submit(1, Arrival::new(a, 10, 10), 0).unwrap();
        assert!(matches!(
            d,
            Decision::Rejected {
                reason: RejectReason::NoHealthyBackend,
                ..
            }
        ));
        g.set_backend_health(0, true);
        assert!(matches!(
            g.submit(2, Arrival::new(a, 10, 10), 0).unwrap(),
            Decision::Admitted { .. }
        ));
    }

    // A kv_usage outside 0..1 or an unknown backend index is an error, not a silent clamp.
    #[test]
    fn bad_observations() {
        let mut g = governor();
        assert!(g
            .observe_backend(0, 0, Some(1.5), None, None, None)
            .is_err());
        assert!(g.observe_backend(9, 0, None, None, None, None).is_err());
    }
}
