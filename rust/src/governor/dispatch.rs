//! Dispatch: which backend a request starts on, and moving queued requests onto free slots.

use super::{us, Governor, Running};
use crate::types::{Admission, ExpiryReason};

impl Governor {
    /// The healthy backend with the most free slots for this tier whose KV can take the
    /// request, or none. (A request that does not fit would only wait in vLLM's own FCFS queue
    /// or be preempted there; waiting here keeps the fair queue in charge of who gets the freed
    /// blocks.) `peak` is the context the request is expected to reach (prompt plus expected
    /// output): with `kv_fit_target` the backend's committed blocks must leave room for it, so
    /// the number of requests running follows the KV capacity, not a fixed count.
    pub(super) fn pick_backend(
        &self,
        tier_idx: usize,
        prompt: u64,
        peak: u64,
        now_us: u64,
    ) -> Option<u32> {
        let tier = &self.config.tiers[tier_idx];
        let peak_blocks = self.ledger.blocks_for(peak);
        let mut best: Option<(u32, u32)> = None;
        for (i, b) in self.backends.iter().enumerate() {
            if !b.healthy {
                continue;
            }
            let (total, share) = self.limits(i, tier, now_us);
            if b.running >= total || b.running_by_tier[tier_idx] >= share {
                continue;
            }
            if !tier.protected
                && self
                    .config
                    .kv_pressure_threshold
                    .is_some_and(|t| self.backend_kv_usage(i, now_us) > t)
            {
                continue;
            }
            // Protected tiers skip the fit check: vLLM's priority scheduling preempts lower
            // tiers to make room for them, and waiting here would only delay a VIP.
            if !tier.protected
                && !(self.fits(i, prompt, peak_blocks, now_us) && self.prefill_paced(i, prompt))
            {
                continue;
            }
            if tier.best_effort && !self.leaves_headroom(i, peak_blocks) {
                continue;
            }
            let headroom = total - b.running;
            if best.is_none_or(|(h, _)| headroom > h) {
                best = Some((headroom, i as u32));
            }
        }
        best.map(|(_, i)| i)
    }

    /// Whether a backend's free KV blocks hold a prompt plus one block of output and, with
    /// `kv_fit_target`, whether its committed blocks leave room for the request's expected
    /// peak. Unknown capacity, or an idle backend, always fits (vLLM is then the judge).
    fn fits(&self, b: usize, prompt: u64, peak_blocks: u64, now_us: u64) -> bool {
        let backend = &self.backends[b];
        let capacity = backend.kv_capacity_blocks;
        if capacity == 0 || backend.running == 0 {
            return true;
        }
        let reported = (self.backend_kv_usage(b, now_us) * capacity as f64).ceil() as u64;
        let used = reported.max(self.ledger.backend_blocks(b as u32));
        if self.ledger.blocks_for(prompt) >= capacity.saturating_sub(used) {
            return false;
        }
        self.config.kv_fit_target.is_none_or(|target| {
            backend.committed_blocks + peak_blocks <= (target * capacity as f64) as u64
        })
    }

    /// Move queued requests onto free slots: tiers in strict order, tenants fairly within.
    ///
    /// Returns first the admissions an earlier `submit` made for requests other than its own
    /// (they already hold their slots), then the new ones, each exactly once.
    pub fn dispatch(&mut self, now_us: u64) -> Vec<Admission> {
        self.tick(now_us);
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
        for tier_idx in 0..self.config.tiers.len() {
            while self.queue.tier_len(tier_idx) > 0 {
                let (prompt, peak) = self.queue.peek(tier_idx).map_or((0, 0), |item| {
                    let req = &self.requests[&item.id];
                    let out = self.expected_output(req.tenant, req.max_tokens);
                    (item.prompt_tokens, item.prompt_tokens + out)
                });
                let Some(backend) = self.pick_backend(tier_idx, prompt, peak, now_us) else {
                    break;
                };
                let Some((_, item)) = self.queue.pop(tier_idx) else {
                    break;
                };
                let req = &self.requests[&item.id];
                let (priority, waited) = (req.priority, now_us.saturating_sub(req.submitted_us));
                self.clear_deadline(item.id, ExpiryReason::QueueTimeout);
                self.start(item.id, backend, now_us);
                admitted.push(Admission {
                    request_id: item.id,
                    backend,
                    priority,
                    queue_wait_us: waited,
                });
            }
        }
        admitted
    }

    /// Give a request its slot: count it on the backend, open its KV entry, commit its expected
    /// peak, charge its prompt.
    pub(super) fn start(&mut self, id: u64, backend: u32, now_us: u64) {
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
        let prefill_alone = b.prefill_pending == 0;
        b.prefill_pending += req.prompt;
        req.running = Some(Running {
            backend,
            admitted_us: now_us,
            first_token: false,
            prefill_alone,
        });
        let (tenant, prompt) = (req.tenant, req.prompt);
        self.ledger.open(id, tenant, backend, prompt, now_us);
        self.queue.served(tenant);
        self.queue
            .charge(tenant, self.config.input_token_weight * prompt as f64);
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
    use crate::types::{Decision, Outcome};

    // A finished request frees its slot; dispatch hands it to the queue head.
    #[test]
    fn dispatch_after_finish() {
        let mut g = governor();
        let a = tenant(&g, "a");
        for id in 1..=3 {
            g.submit(id, a, 10, 10, 0).unwrap();
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
            g.submit(id, a, 10, 10, 0).unwrap();
        }
        g.submit(9, v, 10, 10, 1).unwrap();
        g.finish(1, Outcome::Completed, 2);
        assert_eq!(g.dispatch(2)[0].request_id, 9);
    }

    // max_share keeps a batch flood from taking every slot: batch holds at most 1 of 2 here.
    #[test]
    fn max_share_reserves_slots() {
        let mut g = governor();
        let (z, a) = (tenant(&g, "z"), tenant(&g, "a"));
        assert!(matches!(
            g.submit(1, z, 10, 10, 0).unwrap(),
            Decision::Admitted { .. }
        ));
        assert!(matches!(
            g.submit(2, z, 10, 10, 0).unwrap(),
            Decision::Queued { .. }
        ));
        assert!(matches!(
            g.submit(3, a, 10, 10, 0).unwrap(),
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
        let d = g.submit(1, normal, 15_000, 10, 0).unwrap();
        assert!(matches!(d, Decision::Admitted { .. }), "{d:?}");
        let d = g.submit(2, normal, 2_000, 10, 0).unwrap();
        assert!(matches!(d, Decision::Queued { .. }), "{d:?}");
        assert!(g.dispatch(1).is_empty());
        g.finish(1, Outcome::Completed, 2);
        assert_eq!(g.dispatch(2)[0].request_id, 2);
        let d = g.submit(3, vip, 15_000, 10, 3).unwrap();
        assert!(matches!(d, Decision::Admitted { .. }), "{d:?}");
        // Slots are full now (2 of 2); free one, then a VIP that does not fit still starts.
        assert!(g.finish(2, Outcome::Completed, 3));
        let d = g.submit(4, vip, 2_000, 10, 4).unwrap();
        assert!(matches!(d, Decision::Admitted { .. }), "{d:?}");
    }
}
