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

#[cfg(test)]
mod governor_tests {
    use super::super::tests::{governor, sustained, tenant, S};
    use super::super::{Arrival, Route, Signals};
    use crate::types::{Decision, ExpiryReason, Outcome, RejectReason};

    fn with(fingerprint: u64) -> Route<'static> {
        Route {
            fingerprint,
            ..Route::default()
        }
    }

    fn started(d: &Decision) -> bool {
        matches!(d, Decision::Admitted { .. })
    }

    /// Both slots busy, then request 3 queues at 0 and request 4 at 2 s, past 3's 1.5 s SLA;
    /// returns the order they start in as slots free.
    fn order_after_sla(overwhelmed: bool) -> Vec<u64> {
        let mut g = governor();
        let (a, b) = (tenant(&g, "a"), tenant(&g, "b"));
        if overwhelmed {
            sustained(&mut g, 1, 0); // 1 arrival/s against a 0.2/s drain
        }
        for id in 1..=2 {
            assert!(started(&g.submit(id, Arrival::new(a, 10, 10), 0).unwrap()));
        }
        assert!(matches!(
            g.submit(3, Arrival::new(a, 10, 10), 0).unwrap(),
            Decision::Queued { .. }
        ));
        assert!(matches!(
            g.submit(4, Arrival::new(b, 10, 10), 2 * S).unwrap(),
            Decision::Queued { .. }
        ));
        let mut order = Vec::new();
        for (id, at) in [(1, 2 * S + 1), (2, 2 * S + 2)] {
            g.finish(id, Outcome::Completed, at);
            order.extend(g.dispatch(at).iter().map(|a| a.request_id));
        }
        // Nothing left behind: no lapse entry for a request that started
        assert!(g.lapses.is_empty() && g.queue.is_empty());
        order
    }

    // In an overload the queue cannot hold, the request past its SLA yields to the one that
    // can still be on time; otherwise first come, first served.
    #[test]
    fn late_requests_yield_only_when_overwhelmed() {
        assert_eq!(order_after_sla(true), vec![4, 3]);
        assert_eq!(order_after_sla(false), vec![3, 4]);
    }

    // A client's retry, known by its fingerprint, is judged from its first arrival: past the
    // SLA in an overload, it is never refused for the SLA again (a fresh request still is),
    // and once it gets its first token its client is forgotten.
    #[test]
    fn a_known_retry_is_not_refused_for_the_sla_again() {
        let mut g = governor();
        let a = tenant(&g, "a");
        sustained(&mut g, 1, 0);
        // 13,000 prompt tokens in prefill: a newcomer waits 1.6 s for its first token
        assert!(started(
            &g.submit(1, Arrival::new(a, 13_000, 10), 0).unwrap()
        ));
        let refused = |d: Decision| match d {
            Decision::Rejected { reason, .. } => Some(reason),
            _ => None,
        };
        let first = g
            .submit(2, Arrival::new(a, 10, 10).with_route(with(77)), 0)
            .unwrap();
        assert_eq!(refused(first), Some(RejectReason::TtftSla));
        let fresh = g
            .submit(3, Arrival::new(a, 10, 10).with_route(with(88)), 2 * S)
            .unwrap();
        assert_eq!(refused(fresh), Some(RejectReason::TtftSla));
        let retry = g
            .submit(4, Arrival::new(a, 10, 10).with_route(with(77)), 2 * S)
            .unwrap();
        assert!(started(&retry), "{retry:?}");
        assert_eq!(g.counters.retries_known, 1);
        assert!(g.on_first_token(4, 3 * S));
        assert_eq!(g.retries.first_seen(a, 77, 3 * S), None);
        assert_eq!(g.retries.first_seen(a, 88, 3 * S), Some(2 * S));
    }

    // A request that times out in the queue, or whose client leaves before its first token,
    // is remembered from when it first came; a served one is not.
    #[test]
    fn unserved_ends_are_remembered() {
        let mut g = governor();
        let a = tenant(&g, "a");
        for id in 1..=2 {
            g.submit(id, Arrival::new(a, 10, 10).with_route(with(id)), 0)
                .unwrap();
            assert!(g.on_first_token(id, S / 2));
        }
        g.submit(3, Arrival::new(a, 10, 10).with_route(with(3)), S)
            .unwrap();
        let expired = g.expire(6 * S + 1); // the sample's 5 s queue limit
        assert_eq!(expired.len(), 1);
        assert_eq!(expired[0].reason, ExpiryReason::QueueTimeout);
        assert_eq!(g.retries.first_seen(a, 3, 7 * S), Some(S));
        g.finish(1, Outcome::Completed, 8 * S);
        assert!(started(
            &g.submit(4, Arrival::new(a, 10, 10).with_route(with(4)), 8 * S)
                .unwrap()
        ));
        g.finish(4, Outcome::Cancelled, 9 * S); // its client left before the first token
        assert_eq!(g.retries.first_seen(a, 1, 9 * S), None);
        assert_eq!(g.retries.first_seen(a, 4, 9 * S), Some(8 * S));
        assert!(g.lapses.is_empty()); // the expired one's entry went with it
    }

    // A retry its client announces that the memory does not hold (its first attempt went to
    // another replica) keeps its place by now but is judged past its SLA: in an overload it is
    // not refused for the SLA, where a fresh request is. A count above the config's cap is
    // not honoured, and a count of zero leaves the memory to decide.
    #[test]
    fn an_announced_retry_the_memory_does_not_hold() {
        let mut g = governor();
        let a = tenant(&g, "a");
        sustained(&mut g, 1, 0);
        assert!(started(
            &g.submit(1, Arrival::new(a, 13_000, 10), 0).unwrap()
        ));
        let refused = |d: Decision| match d {
            Decision::Rejected { reason, .. } => Some(reason),
            _ => None,
        };
        let said = |retries| Signals {
            retries: Some(retries),
            deadline_us: None,
        };
        let fresh = Arrival::new(a, 10, 10).with_route(with(88));
        assert_eq!(
            refused(g.submit(2, fresh, 2 * S).unwrap()),
            Some(RejectReason::TtftSla)
        );
        let retry = Arrival::new(a, 10, 10).with_route(with(99));
        let d = g.submit(3, retry.with_signals(said(2)), 2 * S).unwrap();
        assert!(started(&d), "{d:?}");
        assert_eq!(
            (g.counters.retries_announced, g.counters.retries_known),
            (1, 0)
        );
        assert_eq!(g.requests[&3].first_seen_us, 2 * S); // no earlier place
        let runaway = Arrival::new(a, 10, 10).with_route(with(55));
        let d = g.submit(4, runaway.with_signals(said(11)), 2 * S).unwrap();
        assert_eq!(refused(d), Some(RejectReason::TtftSla));
        // Request 2 was refused at 2 s: its body again, with a count of zero, is its retry.
        let d = g.submit(5, fresh.with_signals(said(0)), 4 * S).unwrap();
        assert_eq!(refused(d), None);
        assert_eq!(g.counters.retries_known, 1);
    }
}
