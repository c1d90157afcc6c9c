//! The retry memory: when did the client of a refused request first come?
//!
//! A client refused with a 429 (or a 503 after waiting its queue's limit, or one that gave up
//! before its first token) sends the same request again. To the gateway the retry looks new,
//! so under a long overload every request's retries crowd in with fresh arrivals, each retry
//! already late by the backoffs before it, and each served retry takes the place of a fresh
//! request that could still have been on time (the brownout scenario: 5 to 7 attempts per
//! request, none on time after the surge's first 30 s). The host gives each request a
//! fingerprint (the gateway: a hash of the request body; the simulator: the user request's
//! index); the core remembers, per tenant and fingerprint, when a request that ended without a
//! first token first came, and a later arrival with the same fingerprint is judged from then:
//! past the SLA, it waits in its tier's late lane (`fair_queue`), is never refused for the SLA
//! again (no refusal can make it on time), and keeps its place by first arrival.
//!
//! Bounded: at most `CAPACITY` entries, each forgotten after `TTL_US` or once a request with
//! its fingerprint gets its first token. Two different users sending byte-identical bodies
//! under one tenant share an entry; the later one is then taken for a retry of the earlier,
//! which only matters while the earlier was refused and has not come back.

use std::collections::BTreeSet;

use rustc_hash::FxHashMap;

/// Entries kept at most (about 48 bytes each).
pub(crate) const CAPACITY: usize = 65_536;
/// An entry older than this is forgotten: a client gone this long is not retrying.
pub(crate) const TTL_US: u64 = 600_000_000;

#[derive(Debug, Clone, Default)]
pub(crate) struct RetryMemory {
    first_seen: FxHashMap<(u32, u64), u64>,
    /// The same entries by age, to forget the oldest first.
    by_age: BTreeSet<(u64, u32, u64)>,
}

impl RetryMemory {
    /// When the client of this fingerprint first came, if a request of it ended unserved
    /// within `TTL_US` of `now_us`.
    pub(crate) fn first_seen(&self, tenant: u32, fingerprint: u64, now_us: u64) -> Option<u64> {
        let &at = self.first_seen.get(&(tenant, fingerprint))?;
        (now_us.saturating_sub(at) < TTL_US).then_some(at)
    }

    /// A request first seen at `since_us` ended unserved: its client is expected back.
    pub(crate) fn remember(&mut self, tenant: u32, fingerprint: u64, since_us: u64, now_us: u64) {
        let key = (tenant, fingerprint);
        match self.first_seen.get(&key) {
            Some(&at) if at <= since_us => return,
            Some(&at) => {
                self.by_age.remove(&(at, tenant, fingerprint));
            }
            None => {}
        }
        self.first_seen.insert(key, since_us);
        self.by_age.insert((since_us, tenant, fingerprint));
        while let Some(&(at, t, f)) = self.by_age.first() {
            if self.by_age.len() <= CAPACITY && now_us.saturating_sub(at) < TTL_US {
                break;
            }
            self.by_age.pop_first();
            self.first_seen.remove(&(t, f));
        }
    }

    /// A request of this fingerprint got its first token: its client stops retrying.
    pub(crate) fn forget(&mut self, tenant: u32, fingerprint: u64) {
        if let Some(at) = self.first_seen.remove(&(tenant, fingerprint)) {
            self.by_age.remove(&(at, tenant, fingerprint));
        }
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.first_seen.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000;

    // The first arrival wins; a served request is forgotten; old entries and the oldest beyond
    // the capacity go.
    #[test]
    fn remembers_the_first_arrival_within_bounds() {
        let mut m = RetryMemory::default();
        m.remember(0, 7, 10 * S, 11 * S);
        m.remember(0, 7, 12 * S, 13 * S); // a retry refused again: still first seen at 10 s
        assert_eq!(m.first_seen(0, 7, 14 * S), Some(10 * S));
        assert_eq!(m.first_seen(1, 7, 14 * S), None); // another tenant's body is its own
        assert_eq!(m.first_seen(0, 7, 10 * S + TTL_US), None);
        m.forget(0, 7);
        assert_eq!((m.first_seen(0, 7, 14 * S), m.len()), (None, 0));
        for f in 0..(CAPACITY as u64 + 10) {
            m.remember(0, f, 20 * S + f, 20 * S + f);
        }
        assert_eq!(m.len(), CAPACITY);
        assert_eq!(m.first_seen(0, 0, 30 * S), None); // the oldest went first
        assert!(m.first_seen(0, CAPACITY as u64 + 9, 30 * S).is_some());
        m.remember(0, 1 << 40, 20 * S + TTL_US, 20 * S + TTL_US + 20);
        assert!(m.len() < CAPACITY); // everything older than the TTL went at once
    }
}
