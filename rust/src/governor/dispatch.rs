//! Dispatch: moving queued requests onto free slots (`pick` chooses where), and starting a
//! request on the backend chosen.

use super::{us, Governor, Route, Running};
use crate::config::RoutePolicy;
use crate::types::{Admission, ExpiryReason};

impl Governor {
    /// Move queued requests onto free slots: tiers in strict order, tenants fairly within.
    ///
    /// Returns first the admissions an earlier `submit` made for requests other than its own
    /// (they already hold their slots), then the new ones, each exactly once.
    pub fn dispatch(&mut self, now_us: u64) -> Vec<Admission> {
        self.tick(now_us);
        self.lapse(now_us);
        self.update_headroom(now_us);
        let mut admitted = std::mem::take(&mut self.pending);
        let placed = self.place_queued(now_us);
        self.counters.dispatched += placed.len() as u64;
        admitted.extend(placed);
        admitted
    }

    /// The dispatch loop itself, without counting: `submit` counts its own request apart.
    pub(super) fn place_queued(&mut self, now_us: u64) -> Vec<Admission> {
        let mut admitted = Vec::new();
        // Saturated backends (the common case when anything queues) take nobody: skip the
        // per-tier search, which `submit` would otherwise pay on every request it queues.
        if !self
            .backends
            .iter()
            .any(|b| b.healthy && b.running < b.slots())
        {
            return admitted;
        }
        // Tiers in strict order within each pool; each pool takes its own head, so a pool
        // whose backends are full never holds back another's.
        for tier_idx in 0..self.config.tiers.len() {
            for pool in 0..self.pools.len() as u32 {
                while self.queue.pool_tier_len(pool, tier_idx) > 0 {
                    let Some(item) = self.queue.peek_in(pool, tier_idx) else {
                        break;
                    };
                    let req = &self.requests[&item.id];
                    let out = self.expected_output(req.tenant, req.max_tokens);
                    let (prompt, peak) = (item.prompt_tokens, item.prompt_tokens + out);
                    let route = Route {
                        pool,
                        chain: &req.chain,
                        ..Route::default()
                    };
                    let Some((backend, prefill)) = self.pick(tier_idx, route, prompt, peak, now_us)
                    else {
                        break;
                    };
                    let Some((_, item)) = self.queue.pop_from(pool, tier_idx) else {
                        break;
                    };
                    let req = &self.requests[&item.id];
                    let (priority, waited) =
                        (req.priority, now_us.saturating_sub(req.submitted_us));
                    self.clear_deadline(item.id, ExpiryReason::QueueTimeout);
                    self.clear_deadline(item.id, ExpiryReason::ClientDeadline);
                    self.clear_lapse(item.id);
                    self.start(item.id, backend, prefill, now_us);
                    admitted.push(Admission {
                        request_id: item.id,
                        backend,
                        prefill,
                        priority,
                        queue_wait_us: waited,
                    });
                }
            }
        }
        admitted
    }

    /// Give a request its slot: count it on the backend, open its KV entry, commit its expected
    /// peak, charge its prompt. With `prefill` (a split pool) it also holds a slot on that
    /// prefill instance, where its prompt counts as prefill work, until the hop answers.
    pub(super) fn start(&mut self, id: u64, backend: u32, prefill: Option<u32>, now_us: u64) {
        let (tenant, max_tokens) = {
            let req = &self.requests[&id];
            (req.tenant, req.max_tokens)
        };
        let peak = self.requests[&id].prompt + self.expected_output(tenant, max_tokens);
        let committed = self.ledger.blocks_for(peak);
        let b = &mut self.backends[backend as usize];
        let req = self.requests.get_mut(&id).expect("start: request is live");
        req.committed = committed;
        b.committed_blocks += committed;
        if !self.config.tiers[req.tier].best_effort {
            self.tier_load[req.tier].committed(committed);
        }
        b.running += 1;
        b.running_by_tier[req.tier] += 1;
        let computes = match prefill {
            Some(p) => {
                let p = &mut self.backends[p as usize];
                p.running += 1;
                p.running_by_tier[req.tier] += 1;
                p
            }
            None => b,
        };
        let prefill_alone = computes.prefill_pending == 0;
        computes.prefill_pending += req.prompt;
        req.running = Some(Running {
            backend,
            prefill,
            split: prefill.is_some(),
            admitted_us: now_us,
            first_token: false,
            prefill_alone,
        });
        let (tenant, prompt, pool) = (req.tenant, req.prompt, req.pool);
        if self.pools.policy(pool) == RoutePolicy::Prefix {
            let memory = &mut self.prefix[backend as usize];
            req.prefix_hits = Some(memory.matched(&req.chain) as u64);
            memory.remember(&req.chain);
        }
        self.pools.started(pool, backend);
        self.ledger.open(id, tenant, backend, prompt, now_us);
        self.queue.served_in(pool, tenant);
        self.queue
            .charge_in(pool, tenant, self.config.input_token_weight * prompt as f64);
        if let Some(limit) = us(self.config.first_token_timeout_ms) {
            // The timeout guards against a backend that hangs, not against a long prompt: it
            // runs on top of the prompt's own prefill time at the configured prefill rate
            // (`sla.prefill_tokens_per_s`; a 13k-token prompt needs ~4 s on a 32B model, which
            // no fixed 3 s allows). The configured rate, not the measured one: a deadline must
            // not move with an estimate that a few odd samples can swing.
            let own = (prompt as f64 * 1e6 / self.config.prefill_tokens_per_s) as u64;
            self.set_deadline(id, ExpiryReason::FirstTokenTimeout, now_us + limit + own);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{governor, tenant, S};
    use crate::governor::Arrival;
    use crate::types::{Decision, Outcome};

    // A finished request frees its slot; dispatch hands it to the queue head.
    #[test]
    fn dispatch_after_finish() {
        let mut g = governor();
        let a = tenant(&g, "a");
        for id in 1..=3 {
            g.submit(id, Arrival::new(a, 10, 10), 0).unwrap();
        }
        assert!(g.dispatch(0).is_empty());
        assert!(g.finish(1, Outcome::Completed, S));
        let admitted = g.dispatch(S);
        assert_eq!(admitted.len(), 1);
        assert_eq!((admitted[0].request_id, admitted[0].queue_wait_us), (3, S));
    }

    // VIP queued requests go before normal ones queued earlier (strict tier order).
    #[test]
    fn strict_tier_order() {
        let mut g = governor();
        let (a, v) = (tenant(&g, "a"), tenant(&g, "v"));
        for id in 1..=3 {
            g.submit(id, Arrival::new(a, 10, 10), 0).unwrap();
        }
        g.submit(9, Arrival::new(v, 10, 10), 1).unwrap();
        g.finish(1, Outcome::Completed, 2);
        assert_eq!(g.dispatch(2)[0].request_id, 9);
    }

    // max_share keeps a batch flood from taking every slot: batch holds at most 1 of 2 here.
    #[test]
    fn max_share_reserves_slots() {
        let mut g = governor();
        let (z, a) = (tenant(&g, "z"), tenant(&g, "a"));
        assert!(matches!(
            g.submit(1, Arrival::new(z, 10, 10), 0).unwrap(),
            Decision::Admitted { .. }
        ));
        assert!(matches!(
            g.submit(2, Arrival::new(z, 10, 10), 0).unwrap(),
            Decision::Queued { .. }
        ));
        assert!(matches!(
            g.submit(3, Arrival::new(a, 10, 10), 0).unwrap(),
            Decision::Admitted { .. }
        ));
    }

    // A prompt that does not fit in the free KV blocks waits in the gateway's queue (VIP
    // excepted: vLLM's priority scheduling makes room for it).
    #[test]
    fn prompt_must_fit_free_blocks() {
        let mut g = governor();
        g.config.kv_pressure_threshold = None;
        g.config.ttft_sla_ms = None;
        let (normal, vip) = (tenant(&g, "a"), tenant(&g, "v"));
        // 1000 blocks of 16 tokens: 15,000 tokens hold 938 blocks, leaving 62.
        let d = g.submit(1, Arrival::new(normal, 15_000, 10), 0).unwrap();
        assert!(matches!(d, Decision::Admitted { .. }), "{d:?}");
        let d = g.submit(2, Arrival::new(normal, 2_000, 10), 0).unwrap();
        assert!(matches!(d, Decision::Queued { .. }), "{d:?}");
        assert!(g.dispatch(1).is_empty());
        g.finish(1, Outcome::Completed, 2);
        assert_eq!(g.dispatch(2)[0].request_id, 2);
        let d = g.submit(3, Arrival::new(vip, 15_000, 10), 3).unwrap();
        assert!(matches!(d, Decision::Admitted { .. }), "{d:?}");
        // Slots are full now (2 of 2); free one, then a VIP that does not fit still starts.
        assert!(g.finish(2, Outcome::Completed, 3));
        let d = g.submit(4, Arrival::new(vip, 2_000, 10), 4).unwrap();
        assert!(matches!(d, Decision::Admitted { .. }), "{d:?}");
    }
}
