//! Per-request state: each live request's session, the stall timers of clients whose window
//! is full, and the events that move a request along (arrive, start, tokens, done, the
//! client's window, the client leaving, a refused lease).

use rustc_hash::FxHashMap;
use std::collections::BTreeSet;

use super::{us, Action, PrefillHop, Reason, Refusal, Runtime};
use crate::error::{PolicyError, PolicyResult};
use crate::governor::Arrival;
use crate::types::{Admission, Decision, Outcome};

#[derive(Debug, Clone)]
#[allow(clippy::struct_excessive_bools)] // independent facts about one request, not a mode
pub(super) struct Session {
    pub stream: bool,
    /// `Start` was emitted: ending the request early must abort it upstream.
    pub started: bool,
    pub first_token: bool,
    /// When the stall timer fires, while the client's window is full.
    pub stall_at: Option<u64>,
    /// Upstream finished while the client's window was full: the slot is free, and the reply
    /// ends when the client takes what it is owed (`End`) or stalls for good (`Cut`).
    pub upstream_done: bool,
}

impl Session {
    fn new(stream: bool) -> Self {
        Self {
            stream,
            started: false,
            first_token: false,
            stall_at: None,
            upstream_done: false,
        }
    }
}

/// The sessions of the requests announced and not yet ended, and the stall timers armed
/// among them (by when they fire), kept in step: forgetting a session disarms its timer.
#[derive(Debug, Clone, Default)]
pub(super) struct Sessions {
    live: FxHashMap<u64, Session>,
    stalls: BTreeSet<(u64, u64)>,
}

impl Sessions {
    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn contains(&self, id: u64) -> bool {
        self.live.contains_key(&id)
    }

    pub fn get(&self, id: u64) -> Option<&Session> {
        self.live.get(&id)
    }

    pub fn get_mut(&mut self, id: u64) -> Option<&mut Session> {
        self.live.get_mut(&id)
    }

    fn insert(&mut self, id: u64, session: Session) {
        self.live.insert(id, session);
    }

    /// Drop a request's session (its stall timer too).
    pub fn forget(&mut self, id: u64) -> Option<Session> {
        let s = self.live.remove(&id)?;
        if let Some(at) = s.stall_at {
            self.stalls.remove(&(at, id));
        }
        Some(s)
    }

    /// The client's window filled: a started request's stall timer fires at `at`, unless one
    /// is armed already.
    fn stall(&mut self, id: u64, at: u64) {
        if let Some(s) = self.live.get_mut(&id) {
            if s.started && s.stall_at.is_none() {
                s.stall_at = Some(at);
                self.stalls.insert((at, id));
            }
        }
    }

    /// The client took chunks: its stall timer is off. The session, if live.
    fn unstall(&mut self, id: u64) -> Option<&Session> {
        let s = self.live.get_mut(&id)?;
        if let Some(at) = s.stall_at.take() {
            self.stalls.remove(&(at, id));
        }
        Some(s)
    }

    /// When the first stall timer fires.
    pub fn next_stall(&self) -> Option<u64> {
        self.stalls.first().map(|&(at, _)| at)
    }

    /// The request whose stall timer fires first, if due at `now`, its timer taken off.
    pub fn pop_stalled(&mut self, now: u64) -> Option<u64> {
        let &(at, id) = self.stalls.first().filter(|&&(at, _)| at <= now)?;
        self.stalls.remove(&(at, id));
        if let Some(s) = self.live.get_mut(&id) {
            s.stall_at = None;
        }
        Some(id)
    }

    /// The live ids, in order.
    pub fn ids(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.live.keys().copied().collect();
        ids.sort_unstable();
        ids
    }
}

impl Runtime {
    /// A request arrived: it starts, waits (perhaps pushing out one that waited), or is
    /// refused with a `Reply`.
    pub(super) fn arrive(
        &mut self,
        id: u64,
        arrival: Arrival<'_>,
        stream: bool,
        now: u64,
    ) -> PolicyResult<()> {
        if self.sessions.contains(id) {
            return Err(PolicyError::DuplicateRequest(id));
        }
        let decision = self.gov.submit(id, arrival, now)?;
        let session = Session::new(stream);
        match decision {
            Decision::Admitted {
                backend,
                priority,
                prefill,
            } => {
                self.sessions.insert(id, session);
                self.start(&Admission {
                    request_id: id,
                    backend,
                    prefill,
                    priority,
                    queue_wait_us: 0,
                });
            }
            Decision::Queued {
                position,
                estimated_wait_s,
                displaced,
                ..
            } => {
                if let Some((victim, retry)) = displaced {
                    self.sessions.forget(victim);
                    self.out.push(Action::Reply {
                        id: victim,
                        status: 429,
                        reason: Reason::Displaced,
                        retry_after_s: Some(super::wire_retry_after(retry)),
                    });
                }
                self.sessions.insert(id, session);
                self.out.push(Action::Queued {
                    id,
                    position,
                    estimated_wait_s,
                });
            }
            Decision::Rejected {
                reason,
                retry_after_s,
            } => {
                let refusal = Refusal::of(reason, retry_after_s);
                self.out.push(Action::Reply {
                    id,
                    status: refusal.status,
                    reason: refusal.reason,
                    retry_after_s: Some(refusal.retry_after_s),
                });
            }
        }
        Ok(())
    }

    /// `Start` an admitted request on its backend (after a prefill hop, in a split pool).
    fn start(&mut self, a: &Admission) {
        let id = a.request_id;
        if let Some(s) = self.sessions.get_mut(id) {
            s.started = true;
        }
        let max_tokens = self.gov.browned_out(id);
        let prefill = a.prefill.map(|backend| PrefillHop {
            backend,
            priority: self.gov.hop_priority(id),
        });
        self.start_leased(Action::Start {
            id,
            backend: a.backend,
            priority: a.priority,
            queue_wait_us: a.queue_wait_us,
            max_tokens,
            prefill,
        });
    }

    /// Start whatever the freed room lets the governor dispatch.
    pub(super) fn dispatch(&mut self, now: u64) {
        for a in self.gov.dispatch(now) {
            self.start(&a);
        }
    }

    /// Tokens came (the per-chunk path of `feed` took those after the first). Returns whether
    /// the queue is looked at again: a first token means the request's prefill is done, so a
    /// prompt held back by prefill pacing may start now.
    pub(super) fn tokens(&mut self, id: u64, n: u64, now: u64) -> bool {
        let mut prefill_done = false;
        if let Some(s) = self.sessions.get_mut(id) {
            if n > 0 && s.started && !s.upstream_done {
                prefill_done = !s.first_token;
                s.first_token = true;
                self.gov.on_tokens(id, n, now);
            }
        }
        prefill_done && self.gov.queued() > 0
    }

    /// A split request's prefill hop answered: its prefill instance's slot is free.
    pub(super) fn prefilled(&mut self, id: u64, now: u64) -> bool {
        let live = self
            .sessions
            .get(id)
            .is_some_and(|s| s.started && !s.upstream_done);
        live && self.gov.prefilled(id, now)
    }

    /// Upstream finished: the request ends, or, when its client still owes a full window,
    /// frees its slot now and ends when the client takes what it is owed.
    pub(super) fn done(&mut self, id: u64, now: u64) {
        match self.sessions.get_mut(id) {
            Some(s) if s.stall_at.is_some() && !s.upstream_done => {
                s.upstream_done = true;
                self.gov.finish(id, Outcome::Completed, now);
            }
            Some(s) if !s.upstream_done => self.end(id, Outcome::Completed, now),
            _ => {}
        }
    }

    /// The client went away: abort upstream if it is still running there, and end.
    pub(super) fn client_gone(&mut self, id: u64, now: u64) {
        if let Some(s) = self.sessions.get(id) {
            if s.started && !s.upstream_done {
                self.out.push(Action::Abort { id });
            }
            self.end(id, Outcome::Cancelled, now);
        }
    }

    /// The client's window filled: arm its stall timer (when the lifecycle sets one).
    pub(super) fn window_full(&mut self, id: u64, now: u64) {
        if let Some(timeout) = self.life.stall_timeout_ms.map(us) {
            self.sessions.stall(id, now + timeout);
        }
    }

    /// The client took chunks: disarm its stall timer; a reply whose upstream is done ends.
    pub(super) fn window_drained(&mut self, id: u64, now: u64) {
        if self.sessions.unstall(id).is_some_and(|s| s.upstream_done) {
            self.end(id, Outcome::Completed, now);
        }
    }

    /// Decide a started request again after its lease was refused: it queues, starts on a
    /// backend with room, or is refused with a Retry-After, as a new arrival would be (its
    /// queue deadlines restart, and its tenant's request rate is charged again).
    /// Returns whether room may have freed (always: a new decision may start something).
    pub(super) fn lease_denied(&mut self, id: u64, now: u64) -> PolicyResult<bool> {
        let Some(s) = self.sessions.get(id) else {
            return Ok(false);
        };
        if !s.started || s.first_token || s.upstream_done {
            return Ok(false);
        }
        let stream = s.stream;
        let Some(again) = self.gov.lease_denied(id, now) else {
            return Ok(false);
        };
        self.sessions.forget(id);
        self.arrive(id, again.arrival(), stream, now)?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn started(stream: bool) -> Session {
        Session {
            started: true,
            ..Session::new(stream)
        }
    }

    // Stall timers fire in time order, once each; one that was drained or whose session was
    // forgotten never fires.
    #[test]
    fn stalls_fire_in_order_and_leave_with_their_session() {
        let mut s = Sessions::default();
        for id in 1..=4 {
            s.insert(id, started(true));
        }
        s.stall(1, 300);
        s.stall(2, 100);
        s.stall(2, 50); // armed already: stays at 100
        s.stall(3, 200);
        s.stall(4, 150);
        assert!(s.unstall(4).is_some());
        s.forget(3);
        assert_eq!(s.next_stall(), Some(100));
        assert_eq!(s.pop_stalled(99), None);
        assert_eq!(s.pop_stalled(1_000), Some(2));
        assert_eq!(s.get(2).unwrap().stall_at, None);
        assert_eq!(s.pop_stalled(1_000), Some(1));
        assert_eq!(s.pop_stalled(1_000), None);
        assert_eq!(s.ids(), vec![1, 2, 4]);
    }

    // A request not yet started has no stall timer: nothing of its reply is out to stall.
    #[test]
    fn no_stall_before_start() {
        let mut s = Sessions::default();
        s.insert(1, Session::new(true));
        s.stall(1, 10);
        assert_eq!((s.next_stall(), s.get(1).unwrap().stall_at), (None, None));
        assert!(s.unstall(9).is_none());
    }
}
