//! Expected output: how many tokens a request is likely to generate, learnt from the
//! requests that completed (smoothed per tenant, per tier and over all).

use crate::backend::EWMA_ALPHA;

/// Output tokens of completed requests, smoothed (`None` until one ends): per tenant, then per
/// tier and over all, for tenants with no completed request yet.
#[derive(Debug, Clone)]
pub(crate) struct OutputMemory {
    tenant: Vec<Option<f64>>,
    tier: Vec<Option<f64>>,
    all: Option<f64>,
}

impl OutputMemory {
    pub fn new(tenants: usize, tiers: usize) -> Self {
        Self {
            tenant: vec![None; tenants],
            tier: vec![None; tiers],
            all: None,
        }
    }

    /// Output tokens a request of this tenant (of this tier) is expected to generate: the
    /// tenant's measured mean; for a tenant with no completed request yet, its tier's, else
    /// everyone's (a new tenant's requests are expected to look like the others'); never above
    /// the request's own `max_tokens`, which is the guess until anything is measured.
    pub fn expected(&self, tenant: u32, tier: usize, max_tokens: u64) -> u64 {
        self.tenant[tenant as usize]
            .or(self.tier[tier])
            .or(self.all)
            .map_or(max_tokens, |mean| (mean.ceil() as u64).min(max_tokens))
    }

    /// A request of this tenant (of this tier) completed with `generated` tokens.
    pub fn record(&mut self, tenant: u32, tier: usize, generated: u64) {
        let g = generated as f64;
        let fold =
            |slot: &mut Option<f64>| *slot = Some(slot.map_or(g, |m| m + EWMA_ALPHA * (g - m)));
        fold(&mut self.tenant[tenant as usize]);
        fold(&mut self.tier[tier]);
        fold(&mut self.all);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Nothing measured: the request's own max_tokens. Then the tenant's mean, capped by it; a
    // tenant of the same tier with nothing of its own gets the tier's, one of another tier
    // everyone's.
    #[test]
    fn falls_back_from_tenant_to_tier_to_all() {
        let mut m = OutputMemory::new(3, 2);
        assert_eq!(m.expected(0, 0, 500), 500);
        m.record(0, 0, 100);
        assert_eq!(m.expected(0, 0, 500), 100);
        assert_eq!(m.expected(0, 0, 50), 50);
        assert_eq!(m.expected(1, 0, 500), 100);
        m.record(2, 1, 300);
        assert_eq!(m.expected(2, 1, 500), 300);
        let all = 100.0 + EWMA_ALPHA * 200.0;
        assert_eq!(m.expected(1, 0, 500), 100); // its tier's still
        let mut fresh = OutputMemory::new(3, 3);
        fresh.record(0, 0, 100);
        fresh.record(2, 1, 300);
        assert_eq!(fresh.expected(1, 2, 500), all.ceil() as u64);
    }
}
