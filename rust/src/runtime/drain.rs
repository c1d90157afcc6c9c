//! The drain: stop admitting, and when the drain timeout passes, end what is still live
//! (a started request is cut, a waiting one answered 503).

use super::{us, Action, Reason, Runtime};
use crate::types::Outcome;

impl Runtime {
    /// `Drain`: the governor stops admitting, and the live requests get the drain timeout.
    pub(super) fn drain(&mut self, now: u64) {
        if self.drain_at.is_none() && !self.gov.draining {
            self.gov.start_draining();
            self.drain_at = Some(now + us(self.life.drain_timeout_ms));
        }
    }

    /// The drain timeout passed: end every live request, in id order.
    pub(super) fn end_drain(&mut self, now: u64) {
        for id in self.sessions.ids() {
            let Some(session) = self.sessions.get(id) else {
                continue;
            };
            if session.started {
                self.cut(id, Reason::Shutdown, Outcome::Cancelled, now);
            } else {
                self.sessions.forget(id);
                self.gov.finish(id, Outcome::Cancelled, now);
                self.out.push(Action::Reply {
                    id,
                    status: 503,
                    reason: Reason::Shutdown,
                    retry_after_s: None,
                });
            }
        }
    }
}
