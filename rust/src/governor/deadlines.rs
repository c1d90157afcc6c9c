//! Deadlines: queue wait, first token and total time, kept in one ordered set so the host
//! needs a single timer (`next_deadline_us`) and `expire` finds what is due in O(log n).

use std::collections::BTreeSet;

use super::{Governor, RETRY_AFTER_RANGE};
use crate::types::{Expired, ExpiryReason, Outcome};

/// Every pending deadline, by when it falls (then request id and kind). Each request keeps
/// its own three slots (`Request::deadlines`) so that it can take its entries out when it ends.
#[derive(Debug, Clone, Default)]
pub(crate) struct DeadlineTable {
    due: BTreeSet<(u64, u64, ExpiryReason)>,
}

impl DeadlineTable {
    /// When the earliest deadline falls.
    pub fn next_us(&self) -> Option<u64> {
        self.due.first().map(|&(at, _, _)| at)
    }

    /// The earliest deadline, if it has passed at `now_us`: its request and kind. It stays
    /// until the request ends (`clear`).
    pub fn first_due(&self, now_us: u64) -> Option<(u64, ExpiryReason)> {
        let &(at, id, reason) = self.due.first()?;
        (at <= now_us).then_some((id, reason))
    }

    /// Set a request's deadline of this kind at `at`, noted in its slots.
    pub fn set(&mut self, id: u64, reason: ExpiryReason, at: u64, slots: &mut [Option<u64>; 3]) {
        self.due.insert((at, id, reason));
        slots[reason as usize] = Some(at);
    }

    /// Drop a request's deadline of this kind, if it has one.
    pub fn clear(&mut self, id: u64, reason: ExpiryReason, slots: &mut [Option<u64>; 3]) {
        if let Some(at) = slots[reason as usize].take() {
            self.due.remove(&(at, id, reason));
        }
    }

    /// Drop every deadline of a request that is ending.
    pub fn clear_all(&mut self, id: u64, slots: &[Option<u64>]) {
        for (slot, at) in slots.iter().enumerate() {
            if let Some(at) = at {
                self.due.remove(&(*at, id, ExpiryReason::ALL[slot]));
            }
        }
    }
}

impl Governor {
    /// Earliest pending deadline, so callers know when to call `expire` next.
    pub fn next_deadline_us(&self) -> Option<u64> {
        self.deadlines.next_us()
    }

    /// When the governor next needs the time to move on: the earliest deadline, or the moment
    /// the preemption breaker cools down a level (which frees room for queued requests).
    pub fn next_wakeup_us(&self) -> Option<u64> {
        let breaker = self
            .breaker
            .next_cooldown_us()
            .filter(|_| self.config.preemption_cooldown_ms.is_some());
        [self.next_deadline_us(), breaker]
            .into_iter()
            .flatten()
            .min()
    }

    /// The backend a running request is at upstream, if it is running: its prefill instance
    /// while a split request's prefill hop runs, else the backend it holds.
    pub fn request_backend(&self, id: u64) -> Option<u32> {
        self.requests
            .get(&id)?
            .running
            .as_ref()
            .map(|r| r.prefill.unwrap_or(r.backend))
    }

    /// End every request whose deadline has passed, reporting which and why.
    pub fn expire(&mut self, now_us: u64) -> Vec<Expired> {
        let mut expired = Vec::new();
        while let Some((id, reason)) = self.deadlines.first_due(now_us) {
            let req = &self.requests[&id];
            let (backend, tier) = (self.request_backend(id), req.tier);
            self.finish(id, Outcome::Timeout, now_us);
            self.counters.expired[reason as usize] += 1;
            let wait = (self.queue.len() + 1) as f64 / self.drain_rate();
            let backlog = self.refusal_backlog_s(tier, now_us);
            expired.push(Expired {
                request_id: id,
                reason,
                was_running: backend.is_some(),
                backend,
                retry_after_s: (wait + backlog).clamp(RETRY_AFTER_RANGE.0, RETRY_AFTER_RANGE.1),
            });
        }
        expired
    }

    pub(super) fn set_deadline(&mut self, id: u64, reason: ExpiryReason, at: u64) {
        if let Some(req) = self.requests.get_mut(&id) {
            self.deadlines.set(id, reason, at, &mut req.deadlines);
        }
    }

    pub(super) fn clear_deadline(&mut self, id: u64, reason: ExpiryReason) {
        if let Some(req) = self.requests.get_mut(&id) {
            self.deadlines.clear(id, reason, &mut req.deadlines);
        }
    }

    /// Drop every pending deadline of a request that is ending.
    pub(super) fn clear_deadlines(&mut self, id: u64, deadlines: &[Option<u64>]) {
        self.deadlines.clear_all(id, deadlines);
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{governor, tenant, S};
    use super::DeadlineTable;
    use crate::governor::Arrival;
    use crate::types::ExpiryReason;

    // The table answers the earliest deadline, due or not; a cleared one, or all of an ended
    // request's, are gone.
    #[test]
    fn table_orders_and_clears() {
        let mut t = DeadlineTable::default();
        let (mut one, mut two) = ([None; 3], [None; 3]);
        t.set(1, ExpiryReason::Deadline, 300, &mut one);
        t.set(1, ExpiryReason::QueueTimeout, 100, &mut one);
        t.set(2, ExpiryReason::FirstTokenTimeout, 200, &mut two);
        assert_eq!((t.next_us(), t.first_due(99)), (Some(100), None));
        assert_eq!(t.first_due(100), Some((1, ExpiryReason::QueueTimeout)));
        t.clear(1, ExpiryReason::QueueTimeout, &mut one);
        assert_eq!(one, [None, None, Some(300)]);
        assert_eq!(t.first_due(250), Some((2, ExpiryReason::FirstTokenTimeout)));
        t.clear_all(2, &two);
        t.clear_all(1, &one);
        assert_eq!(t.next_us(), None);
    }

    // Deadlines: queue wait, first token and total, each reported once with its reason.
    #[test]
    fn deadlines_expire() {
        let mut g = governor();
        let a = tenant(&g, "a");
        for id in 1..=3 {
            g.submit(id, Arrival::new(a, 10, 10), 0).unwrap();
        }
        g.on_first_token(1, S);
        let expired = g.expire(4 * S);
        assert_eq!(expired.len(), 1);
        assert_eq!(
            (expired[0].request_id, expired[0].reason),
            (2, ExpiryReason::FirstTokenTimeout)
        );
        let expired = g.expire(6 * S);
        assert_eq!(
            (expired[0].request_id, expired[0].reason),
            (3, ExpiryReason::QueueTimeout)
        );
        assert!(!expired[0].was_running);
        assert!(expired[0].retry_after_s > 0.0);
        let expired = g.expire(61 * S);
        assert_eq!(
            (expired[0].request_id, expired[0].reason),
            (1, ExpiryReason::Deadline)
        );
        assert_eq!((g.live(), g.next_deadline_us()), (0, None));
    }
}
