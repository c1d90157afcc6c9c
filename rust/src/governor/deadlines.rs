//! Deadlines: queue wait, first token and total time, kept in one ordered set so the host
//! needs a single timer (`next_deadline_us`) and `expire` finds what is due in O(log n).

use super::{Governor, RETRY_AFTER_RANGE};
use crate::types::{Expired, ExpiryReason, Outcome};

impl Governor {
    /// Earliest pending deadline, so callers know when to call `expire` next.
    pub fn next_deadline_us(&self) -> Option<u64> {
        self.deadlines.first().map(|&(at, _, _)| at)
    }

    /// When the governor next needs the time to move on: the earliest deadline, or the moment
    /// the preemption breaker cools down a level (which frees room for queued requests).
    pub fn next_wakeup_us(&self) -> Option<u64> {
        let breaker = (self.shed_level > 0 && self.config.preemption_cooldown_ms.is_some())
            .then_some(self.breaker_until_us);
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
        while let Some(&(at, id, reason)) = self.deadlines.first() {
            if at > now_us {
                break;
            }
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
        self.deadlines.insert((at, id, reason));
        if let Some(req) = self.requests.get_mut(&id) {
            req.deadlines[reason as usize] = Some(at);
        }
    }

    pub(super) fn clear_deadline(&mut self, id: u64, reason: ExpiryReason) {
        if let Some(req) = self.requests.get_mut(&id) {
            if let Some(at) = req.deadlines[reason as usize].take() {
                self.deadlines.remove(&(at, id, reason));
            }
        }
    }

    /// Drop every pending deadline of a request that is ending.
    pub(super) fn clear_deadlines(&mut self, id: u64, deadlines: &[Option<u64>]) {
        for (slot, at) in deadlines.iter().enumerate() {
            if let Some(at) = at {
                self.deadlines.remove(&(*at, id, ExpiryReason::ALL[slot]));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{governor, tenant, S};
    use crate::governor::Arrival;
    use crate::types::ExpiryReason;

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
