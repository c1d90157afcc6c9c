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

    /// The requests whose deadline of this kind has passed at `now_us`, earliest first.
    pub fn due_of(&self, reason: ExpiryReason, now_us: u64) -> Vec<u64> {
        self.due
            .iter()
            .take_while(|&&(at, _, _)| at <= now_us)
            .filter(|&&(_, _, r)| r == reason)
            .map(|&(_, id, _)| id)
            .collect()
    }

    /// Set a request's deadline of this kind at `at`, noted in its slots.
    pub fn set(
        &mut self,
        id: u64,
        reason: ExpiryReason,
        at: u64,
        slots: &mut [Option<u64>; ExpiryReason::ALL.len()],
    ) {
        self.due.insert((at, id, reason));
        slots[reason as usize] = Some(at);
    }

    /// Drop a request's deadline of this kind, if it has one.
    pub fn clear(
        &mut self,
        id: u64,
        reason: ExpiryReason,
        slots: &mut [Option<u64>; ExpiryReason::ALL.len()],
    ) {
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
            expired.push(self.expire_one(id, reason, now_us));
        }
        expired
    }

    /// End only the queued requests whose client deadline has passed (the other deadlines wait
    /// for the host's timer, as they always have). A host's timer fires a little after its
    /// time, and an event before it may free a slot: the runtime calls this before anything
    /// can start, so a request whose client has given up is never started.
    pub fn expire_client_deadlines(&mut self, now_us: u64) -> Vec<Expired> {
        if self.deadlines.first_due(now_us).is_none() {
            return Vec::new();
        }
        let due = self.deadlines.due_of(ExpiryReason::ClientDeadline, now_us);
        due.into_iter()
            .map(|id| self.expire_one(id, ExpiryReason::ClientDeadline, now_us))
            .collect()
    }

    fn expire_one(&mut self, id: u64, reason: ExpiryReason, now_us: u64) -> Expired {
        let req = &self.requests[&id];
        let (backend, tier) = (self.request_backend(id), req.tier);
        self.finish(id, Outcome::Timeout, now_us);
        self.counters.expired[reason as usize] += 1;
        let wait = (self.queue.len() + 1) as f64 / self.drain_rate();
        let backlog = self.refusal_backlog_s(tier, now_us);
        Expired {
            request_id: id,
            reason,
            was_running: backend.is_some(),
            backend,
            retry_after_s: (wait + backlog).clamp(RETRY_AFTER_RANGE.0, RETRY_AFTER_RANGE.1),
        }
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
    use super::Governor;
    use crate::governor::{Arrival, Signals};
    use crate::types::{Decision, ExpiryReason, Outcome, RejectReason};

    // The table answers the earliest deadline, due or not; a cleared one, or all of an ended
    // request's, are gone.
    #[test]
    fn table_orders_and_clears() {
        let mut t = DeadlineTable::default();
        let (mut one, mut two) = (
            [None; ExpiryReason::ALL.len()],
            [None; ExpiryReason::ALL.len()],
        );
        t.set(1, ExpiryReason::Deadline, 300, &mut one);
        t.set(1, ExpiryReason::QueueTimeout, 100, &mut one);
        t.set(2, ExpiryReason::FirstTokenTimeout, 200, &mut two);
        assert_eq!((t.next_us(), t.first_due(99)), (Some(100), None));
        assert_eq!(t.first_due(100), Some((1, ExpiryReason::QueueTimeout)));
        t.clear(1, ExpiryReason::QueueTimeout, &mut one);
        assert_eq!(one, [None, None, Some(300), None]);
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

    fn within(ms: u64) -> Signals {
        Signals {
            retries: None,
            deadline_us: Some(ms * 1000),
        }
    }

    /// The sample with both slots taken at 0: a newcomer waits behind them, 5 s by the prior
    /// drain (2 slots over a 10 s hold).
    fn full() -> (Governor, u32) {
        let mut g = governor();
        let a = tenant(&g, "a");
        for id in 1..=2 {
            g.submit(id, Arrival::new(a, 10, 10), 0).unwrap();
        }
        (g, a)
    }

    // A client deadline the queue cannot meet is refused at once, told when its budget will
    // suffice, and nothing of it stays; one the queue meets waits; with the config's
    // deadlines off the same request waits; a budget below the floor counts as the floor.
    #[test]
    fn a_deadline_the_queue_cannot_meet_is_refused_at_once() {
        let (mut g, a) = full();
        let short = Arrival::new(a, 10, 10).with_signals(within(4_000));
        match g.submit(3, short, 0).unwrap() {
            Decision::Rejected {
                reason,
                retry_after_s,
            } => {
                assert_eq!(reason, RejectReason::ClientDeadline);
                assert!((retry_after_s - 1.0).abs() < 1e-9, "{retry_after_s}"); // 5 s - 4 s
            }
            d => panic!("{d:?}"),
        }
        assert!(!g.is_live(3) && g.queued() == 0);
        assert_eq!(
            g.counters.rejected[RejectReason::ClientDeadline as usize],
            1
        );
        let long = Arrival::new(a, 10, 10).with_signals(within(6_000));
        assert!(matches!(
            g.submit(4, long, 0).unwrap(),
            Decision::Queued { .. }
        ));
        let (mut off, _) = full();
        off.config.signals.deadlines = false;
        assert!(matches!(
            off.submit(3, short, 0).unwrap(),
            Decision::Queued { .. }
        ));
        let (mut floor, a) = full();
        floor.config.signals.min_deadline_ms = 20_000.0;
        let zero = Arrival::new(a, 10, 10).with_signals(within(0));
        assert!(matches!(
            floor.submit(3, zero, 0).unwrap(),
            Decision::Queued { .. }
        ));
        assert_eq!(floor.requests[&3].client_deadline_us, Some(20 * S));
    }

    // A queued request leaves the queue once its client's deadline passes (a queue limit
    // further off), before the slot freed meanwhile can start it, and never starts; one
    // started before its deadline keeps running past it.
    #[test]
    fn a_passed_client_deadline_leaves_the_queue() {
        let (mut g, a) = full();
        g.config.queue_timeout_ms = Some(20_000.0);
        // Second in line, 4 waits 10 s by the estimate: an 11 s budget lets it queue.
        let waits = |ms| Arrival::new(a, 10, 10).with_signals(within(ms));
        g.submit(3, waits(6_000), 0).unwrap();
        g.submit(4, waits(11_000), 0).unwrap();
        assert!(g.expire_client_deadlines(6 * S - 1).is_empty());
        g.finish(1, Outcome::Completed, 5 * S);
        assert_eq!(g.dispatch(5 * S)[0].request_id, 3); // on time: it starts
        assert!(g.expire_client_deadlines(11 * S - 1).is_empty()); // running: its own is off
        g.finish(2, Outcome::Completed, 12 * S);
        let gone = g.expire_client_deadlines(12 * S);
        assert_eq!(gone.len(), 1);
        let e = &gone[0];
        assert_eq!(
            (e.request_id, e.reason, e.was_running),
            (4, ExpiryReason::ClientDeadline, false)
        );
        assert!(g.dispatch(12 * S).is_empty());
        assert_eq!((g.queued(), g.is_live(4), g.is_live(3)), (0, false, true));
        assert!(g
            .expire(60 * S)
            .iter()
            .all(|e| e.reason != ExpiryReason::ClientDeadline));
    }

    // Under fair order a light tenant's wait is not its tier's whole backlog: behind a heavy
    // tenant's five queued requests, a's first waits for about one of them (10 s by the prior
    // drain) and meets a 12 s deadline, where b's sixth (35 s) is refused; in FIFO order a's
    // waits behind all five and is refused too.
    #[test]
    fn the_expected_wait_follows_the_fair_order() {
        for strategy in [crate::config::Strategy::Fair, crate::config::Strategy::Fifo] {
            let mut g = governor();
            g.config.max_waiting = 50;
            g.queue = crate::fair_queue::FairQueue::pooled(
                strategy,
                3,
                &[(0, 1.0), (1, 1.0), (1, 1.0), (2, 1.0)],
                1,
            );
            let (a, b) = (tenant(&g, "a"), tenant(&g, "b"));
            for id in 1..=7 {
                g.submit(id, Arrival::new(b, 10, 10), 0).unwrap();
            }
            assert_eq!(g.queued(), 5);
            let soon = |t| Arrival::new(t, 10, 10).with_signals(within(12_000));
            let light = g.submit(8, soon(a), 0).unwrap();
            let heavy = g.submit(9, soon(b), 0).unwrap();
            let refused = |d: &Decision| {
                matches!(
                    d,
                    Decision::Rejected {
                        reason: RejectReason::ClientDeadline,
                        ..
                    }
                )
            };
            let fair = strategy == crate::config::Strategy::Fair;
            assert_eq!(refused(&light), !fair, "{strategy:?}: {light:?}");
            assert!(refused(&heavy), "{strategy:?}: {heavy:?}");
        }
    }
}
