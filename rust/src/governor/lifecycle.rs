//! A running request's progress (first token, generated tokens) and the end of every request.

use super::Governor;
use crate::backend::EWMA_ALPHA;
use crate::types::Outcome;

/// Context tokens per extra unit of output cost: with `kv_weight` 1 a token generated on a
/// 4k context costs 4 more than one on an empty context, since it holds 4x the KV.
const KV_COST_TOKENS: f64 = 1024.0;

impl Governor {
    /// Record a running request's first token. Returns false if it is not running.
    pub fn on_first_token(&mut self, id: u64, now_us: u64) -> bool {
        let Some(req) = self.requests.get_mut(&id) else {
            return false;
        };
        let Some(run) = req.running.as_mut() else {
            return false;
        };
        if run.first_token {
            return true;
        }
        run.first_token = true;
        if req.fingerprint != 0 {
            self.retries.forget(req.tenant, req.fingerprint);
        }
        let alone = run.alone_us(now_us);
        if let Some(p) = run.prefill.take() {
            // A first token proves the prefill hop over, reported or not.
            self.backends[p as usize].prefill_hop_answered(req.tier, req.prompt, alone, now_us);
        }
        let b = &mut self.backends[run.backend as usize];
        if !run.split {
            b.record_prefill(req.prompt, alone, now_us);
            b.prefill_pending -= req.prompt;
        }
        b.decoding += 1;
        self.clear_deadline(id, crate::types::ExpiryReason::FirstTokenTimeout);
        true
    }

    /// A split request's prefill hop answered: its prompt's KV is on its prefill instance, and
    /// that instance's slot is free (vLLM's connector keeps the blocks until the decode
    /// instance has read them; they are not counted here). Returns false if the request has
    /// no prefill hop running.
    pub fn prefilled(&mut self, id: u64, now_us: u64) -> bool {
        let Some(req) = self.requests.get_mut(&id) else {
            return false;
        };
        let Some(run) = req.running.as_mut() else {
            return false;
        };
        let Some(p) = run.prefill.take() else {
            return false;
        };
        let alone = run.alone_us(now_us);
        self.backends[p as usize].prefill_hop_answered(req.tier, req.prompt, alone, now_us);
        true
    }

    /// Record `n` more generated tokens (the first ones also count as the first token).
    /// Returns false if the request is not running.
    pub fn on_tokens(&mut self, id: u64, n: u64, now_us: u64) -> bool {
        if n == 0 || !self.on_first_token(id, now_us) {
            return n == 0 && self.requests.get(&id).is_some_and(|r| r.running.is_some());
        }
        let req = self
            .requests
            .get_mut(&id)
            .expect("on_tokens: checked above");
        req.generated += n;
        let context = (req.prompt + req.generated) as f64;
        let (tenant, pool) = (req.tenant, req.pool);
        if let Some(run) = req.running.as_ref() {
            self.backends[run.backend as usize].record_decoded(n);
        }
        if let Some(blocks) = self.ledger.grow(id, n, now_us) {
            // Past its expected peak a request commits what it really holds.
            if blocks > req.committed {
                let backend = req.running.as_ref().map_or(0, |r| r.backend);
                self.backends[backend as usize].committed_blocks += blocks - req.committed;
                req.committed = blocks;
            }
        }
        let per_token =
            self.config.output_token_weight + self.config.kv_weight * context / KV_COST_TOKENS;
        self.queue.charge_in(pool, tenant, per_token * n as f64);
        self.pay_tokens(tenant, n);
        true
    }

    /// End a live request and free everything it held. Returns false if it was not live.
    pub fn finish(&mut self, id: u64, outcome: Outcome, now_us: u64) -> bool {
        self.finish_as(id, Some(outcome), now_us)
    }

    /// End a request; `None` is a displaced one, counted as a refusal rather than an outcome.
    pub(super) fn finish_as(&mut self, id: u64, outcome: Option<Outcome>, now_us: u64) -> bool {
        let Some(req) = self.requests.remove(&id) else {
            return false;
        };
        self.clear_deadlines(id, &req.deadlines);
        let served = req.running.as_ref().is_some_and(|r| r.first_token);
        if self.remembers(req.fingerprint) && !served && outcome != Some(Outcome::Completed) {
            // Refused, timed out or given up before its first token: its client comes back.
            self.retries
                .remember(req.tenant, req.fingerprint, req.first_seen_us, now_us);
        }
        if !self.pending.is_empty() {
            // Ended before the host collected its admission: it must not be handed out.
            self.pending.retain(|a| a.request_id != id);
        }
        match req.running {
            None => {
                self.queue.remove(id);
                if let Some(at) = self.lapse_time(req.tier, req.sla_from_us) {
                    self.lapses.remove(&(at, id)); // see `clear_lapse`
                }
            }
            Some(run) => {
                if let Some(p) = run.prefill {
                    self.backends[p as usize].prefill_hop_ended(req.tier, req.prompt);
                }
                let b = &mut self.backends[run.backend as usize];
                b.running -= 1;
                b.running_by_tier[req.tier] -= 1;
                b.committed_blocks -= req.committed;
                if run.first_token {
                    b.decoding -= 1;
                } else if !run.split {
                    b.prefill_pending -= req.prompt;
                }
                self.ledger.close(id, now_us);
                if outcome == Some(Outcome::Completed) {
                    let took = now_us.saturating_sub(run.admitted_us) as f64 / 1e6;
                    let smoothed = self.service_s.map_or(took, |s| s + EWMA_ALPHA * (took - s));
                    self.service_s = Some(smoothed.max(1e-3));
                    self.tier_load[req.tier].held(took.max(1e-3));
                    self.record_output(req.tenant, req.generated);
                }
            }
        }
        if let Some(outcome) = outcome {
            self.counters.finished[outcome as usize] += 1;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{governor, tenant};
    use crate::governor::Arrival;
    use crate::types::Outcome;

    // KV grows with tokens and everything returns to zero when work ends; ending twice is a
    // no-op.
    #[test]
    fn ledger_returns_to_zero() {
        let mut g = governor();
        let a = tenant(&g, "a");
        g.submit(1, Arrival::new(a, 20, 100), 0).unwrap();
        g.on_tokens(1, 30, 10);
        assert_eq!(g.ledger.total_blocks(), 4);
        assert!(g.finish(1, Outcome::Completed, 20));
        assert!(!g.finish(1, Outcome::Completed, 20));
        assert_eq!((g.ledger.total_blocks(), g.running(), g.live()), (0, 0, 0));
        assert_eq!(g.counters.finished[Outcome::Completed as usize], 1);
    }

    // Tokens for a queued or unknown request are refused; zero tokens on a running one is fine.
    #[test]
    fn tokens_need_a_running_request() {
        let mut g = governor();
        let a = tenant(&g, "a");
        for id in 1..=3 {
            g.submit(id, Arrival::new(a, 10, 10), 0).unwrap();
        }
        assert!(g.on_tokens(1, 0, 1));
        assert!(!g.on_tokens(3, 5, 1));
        assert!(!g.on_first_token(3, 1));
        assert!(!g.on_tokens(99, 5, 1));
    }
}
