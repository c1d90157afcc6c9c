//! Deadlines and the one timer: what is due when the host's timer fires, and when it must
//! fire next.

use super::{Reason, Runtime};
use crate::types::Outcome;

/// The timer the host holds now: what the last `Arm` said, if anything.
#[derive(Debug, Clone, Default)]
pub(super) struct Timer {
    armed: Option<u64>,
}

impl Timer {
    /// The host's timer fired: none is held now.
    pub fn fired(&mut self) {
        self.armed = None;
    }

    /// Whether the host must (re)arm its timer for `next`, recorded if so. Only an earlier
    /// time needs the timer moved: one set later fires early, finds nothing due, and is
    /// re-armed then (one timer event instead of a reset per request).
    pub fn rearm(&mut self, next: u64) -> bool {
        let earlier = self.armed.is_none_or(|armed| next < armed);
        if earlier {
            self.armed = Some(next);
        }
        earlier
    }
}

impl Runtime {
    /// When the host's timer should fire next, if anything is pending.
    pub fn next_timer_us(&self) -> Option<u64> {
        [
            self.gov.next_wakeup_us(),
            self.sessions.next_stall(),
            self.drain_at,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Everything due at `now`: deadlines, stalled clients, the end of the drain.
    pub(super) fn fire(&mut self, now: u64) {
        for expired in self.gov.expire(now) {
            self.expired(&expired);
        }
        while let Some(id) = self.sessions.pop_stalled(now) {
            self.cut(id, Reason::ClientStall, Outcome::Cancelled, now);
        }
        if self.drain_at.is_some_and(|at| at <= now) {
            self.drain_at = None;
            self.end_drain(now);
        }
    }

    /// Queued requests whose client has given up leave before anything else happens (the
    /// timer handles the rest): none may start in a slot this event frees.
    pub(super) fn expire_client_deadlines(&mut self, now: u64) {
        for expired in self.gov.expire_client_deadlines(now) {
            self.expired(&expired);
        }
    }

    pub(super) fn rearm(&mut self) {
        if let Some(next) = self.next_timer_us() {
            if self.timer.rearm(next) {
                self.out.push(super::Action::Arm { at_us: next });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The host's timer moves only to an earlier time, and after it fired any time arms it.
    #[test]
    fn rearms_only_earlier() {
        let mut t = Timer::default();
        assert!(t.rearm(100));
        assert!(!t.rearm(100));
        assert!(!t.rearm(200));
        assert!(t.rearm(50));
        t.fired();
        assert!(t.rearm(200));
    }
}
