//! Per-tenant rate limits: token buckets on requests per second and on prompt plus output
//! tokens per minute, so that one tenant cannot take the queue or the token budget of the
//! others. Time is an argument, like everywhere in the core.
//!
//! The request bucket holds a second's worth (at least one request) and the token bucket a
//! minute's worth; both start full. A request is let in while its tenant's request bucket holds
//! a whole request and its token bucket holds its prompt (a prompt larger than the whole
//! bucket needs a full bucket); it then pays one request and its prompt. Output tokens are
//! paid as they stream, and may take the token bucket below zero: the tenant's next request
//! waits until it has refilled. A refusal says exactly when that will be.

use super::Governor;

/// One tenant's buckets, as of `at_us`.
#[derive(Debug, Clone, Default)]
pub(crate) struct Buckets {
    requests: f64,
    tokens: f64,
    at_us: u64,
    /// What this replica let the tenant use, ever: requests and tokens (published to the
    /// other replicas when they share state).
    used_requests: f64,
    used_tokens: f64,
}

impl Governor {
    fn bucket_rates(&self, tenant: u32) -> (Option<f64>, Option<f64>) {
        let t = &self.config.tenants[tenant as usize];
        (t.requests_per_s, t.tokens_per_min.map(|m| m / 60.0))
    }

    /// Refill a tenant's buckets up to `now_us`.
    fn refill(&mut self, tenant: u32, now_us: u64) {
        let (req_rate, tok_rate) = self.bucket_rates(tenant);
        let t = &self.config.tenants[tenant as usize];
        let (req_cap, tok_cap) = (
            t.requests_per_s.map_or(0.0, |r| r.max(1.0)),
            t.tokens_per_min.unwrap_or(0.0),
        );
        let b = &mut self.buckets[tenant as usize];
        let elapsed = now_us.saturating_sub(b.at_us) as f64 / 1e6;
        b.at_us = b.at_us.max(now_us);
        if let Some(rate) = req_rate {
            b.requests = (b.requests + rate * elapsed).min(req_cap);
        }
        if let Some(rate) = tok_rate {
            b.tokens = (b.tokens + rate * elapsed).min(tok_cap);
        }
    }

    /// Seconds until the tenant may send a request of `prompt` tokens; `None`: it may now.
    /// Refills the buckets to `now_us` first.
    pub(super) fn rate_limited(&mut self, tenant: u32, prompt: u64, now_us: u64) -> Option<f64> {
        let (req_rate, tok_rate) = self.bucket_rates(tenant);
        if req_rate.is_none() && tok_rate.is_none() {
            return None;
        }
        self.refill(tenant, now_us);
        self.rate_wait(tenant, prompt, now_us)
    }

    /// `rate_limited` without changing anything: the buckets as they would be at `now_us`.
    pub(super) fn rate_wait(&self, tenant: u32, prompt: u64, now_us: u64) -> Option<f64> {
        let (req_rate, tok_rate) = self.bucket_rates(tenant);
        if req_rate.is_none() && tok_rate.is_none() {
            return None;
        }
        let mut b = self.buckets[tenant as usize].clone();
        let t = &self.config.tenants[tenant as usize];
        let elapsed = now_us.saturating_sub(b.at_us) as f64 / 1e6;
        let mut wait: f64 = 0.0;
        if let Some(rate) = req_rate {
            b.requests = (b.requests + rate * elapsed).min(rate.max(1.0));
            wait = wait.max((1.0 - b.requests) / rate);
        }
        if let (Some(rate), Some(cap)) = (tok_rate, t.tokens_per_min) {
            b.tokens = (b.tokens + rate * elapsed).min(cap);
            let need = (prompt as f64).min(cap);
            wait = wait.max((need - b.tokens) / rate);
        }
        (wait > 0.0).then_some(wait)
    }

    /// A request of the tenant was let in (admitted or queued): it pays one request and its
    /// prompt.
    pub(super) fn pay_request(&mut self, tenant: u32, prompt: u64) {
        let b = &mut self.buckets[tenant as usize];
        b.requests -= 1.0;
        b.tokens -= prompt as f64;
        b.used_requests += 1.0;
        b.used_tokens += prompt as f64;
    }

    /// Output tokens streamed for the tenant.
    pub(super) fn pay_tokens(&mut self, tenant: u32, n: u64) {
        let b = &mut self.buckets[tenant as usize];
        b.tokens -= n as f64;
        b.used_tokens += n as f64;
    }

    /// Requests and tokens this governor let `tenant` use, ever (not what other replicas did).
    pub fn tenant_usage(&self, tenant: u32) -> (f64, f64) {
        let b = &self.buckets[tenant as usize];
        (b.used_requests, b.used_tokens)
    }

    /// Other gateway replicas let `tenant` use `requests` and `tokens` since the last sync:
    /// its buckets pay for them too, so the limit holds over all replicas together (each
    /// replica's buckets then see the tenant's whole use, one sync period late).
    pub fn charge_usage_elsewhere(
        &mut self,
        tenant: u32,
        requests: f64,
        tokens: f64,
        now_us: u64,
    ) -> crate::error::PolicyResult<()> {
        if tenant as usize >= self.buckets.len() {
            return Err(crate::error::PolicyError::invalid(format!(
                "tenant index {tenant} out of range"
            )));
        }
        self.refill(tenant, now_us);
        let b = &mut self.buckets[tenant as usize];
        if requests.is_finite() && requests > 0.0 {
            b.requests -= requests;
        }
        if tokens.is_finite() && tokens > 0.0 {
            b.tokens -= tokens;
        }
        Ok(())
    }

    /// Buckets start full.
    pub(super) fn full_buckets(config: &crate::config::PolicyConfig) -> Vec<Buckets> {
        config
            .tenants
            .iter()
            .map(|t| Buckets {
                requests: t.requests_per_s.map_or(0.0, |r| r.max(1.0)),
                tokens: t.tokens_per_min.unwrap_or(0.0),
                at_us: 0,
                used_requests: 0.0,
                used_tokens: 0.0,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{tenant, S};
    use super::super::Governor;
    use crate::config::tests::sample_json;
    use crate::governor::Arrival;
    use crate::types::{Decision, RejectReason};

    fn limited(extra: &str) -> Governor {
        let text = sample_json().replace(
            r#"{"name":"a","tier":"normal"}"#,
            &format!(r#"{{"name":"a","tier":"normal",{extra}}}"#),
        );
        Governor::from_json(&text).unwrap()
    }

    fn refused(d: Decision) -> f64 {
        match d {
            Decision::Rejected {
                reason: RejectReason::RateLimited,
                retry_after_s,
            } => retry_after_s,
            other => panic!("{other:?}"),
        }
    }

    // What other replicas let the tenant use is paid from this replica's buckets too: two
    // requests used elsewhere leave none here, until they refill; this replica publishes
    // only its own use.
    #[test]
    fn usage_elsewhere_is_paid_here() {
        let mut g = limited(r#""requests_per_s":2"#);
        let a = tenant(&g, "a");
        g.config.ttft_sla_ms = None;
        g.charge_usage_elsewhere(a, 2.0, 20.0, 0).unwrap();
        assert!((refused(g.submit(1, Arrival::new(a, 10, 10), 0).unwrap()) - 0.5).abs() < 1e-9);
        assert_eq!(g.tenant_usage(a), (0.0, 0.0));
        assert!(!matches!(
            g.submit(2, Arrival::new(a, 10, 10), S / 2).unwrap(),
            Decision::Rejected { .. }
        ));
        assert_eq!(g.tenant_usage(a), (1.0, 10.0));
        assert!(g.charge_usage_elsewhere(99, 1.0, 1.0, S).is_err());
    }

    // 2 requests/s: a burst of two, then one every half second; the refusal says when.
    #[test]
    fn requests_per_second() {
        let mut g = limited(r#""requests_per_s":2"#);
        let (a, b) = (tenant(&g, "a"), tenant(&g, "b"));
        g.config.ttft_sla_ms = None;
        assert!(!matches!(
            g.submit(1, Arrival::new(a, 10, 10), 0).unwrap(),
            Decision::Rejected { .. }
        ));
        assert!(!matches!(
            g.submit(2, Arrival::new(a, 10, 10), 0).unwrap(),
            Decision::Rejected { .. }
        ));
        let wait = refused(g.submit(3, Arrival::new(a, 10, 10), 0).unwrap());
        assert!((wait - 0.5).abs() < 1e-9, "{wait}");
        // another tenant is not limited by a's bucket
        assert!(!matches!(
            g.submit(4, Arrival::new(b, 10, 10), 0).unwrap(),
            Decision::Rejected { .. }
        ));
        assert!(!matches!(
            g.submit(5, Arrival::new(a, 10, 10), S / 2).unwrap(),
            Decision::Rejected { .. }
        ));
        assert_eq!(g.counters.rejected[RejectReason::RateLimited as usize], 1);
    }

    // 600 tokens/min (10 per second): prompts pay on entry, output as it streams, and a
    // tenant in debt waits until its bucket covers the next prompt.
    #[test]
    fn tokens_per_minute() {
        let mut g = limited(r#""tokens_per_min":600"#);
        g.config.ttft_sla_ms = None;
        let a = tenant(&g, "a");
        assert!(!matches!(
            g.submit(1, Arrival::new(a, 500, 10), 0).unwrap(),
            Decision::Rejected { .. }
        ));
        g.on_tokens(1, 150, 1); // 600 - 500 - 150 = -50 tokens
        let wait = refused(g.submit(2, Arrival::new(a, 100, 10), 1).unwrap());
        assert!((wait - 15.0).abs() < 1e-3, "{wait}"); // (100 + 50) / 10 per s
        assert!(!matches!(
            g.submit(3, Arrival::new(a, 100, 10), 16 * S).unwrap(),
            Decision::Rejected { .. }
        ));
    }
}
