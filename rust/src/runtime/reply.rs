//! Rendering: how a request's end goes on the wire. A refusal's status and Retry-After, an
//! upstream failure's status (or an in-band cut once the reply is committed), a missed
//! deadline's reply or cut, and the `End` of a request that finished.

use serde::Serialize;

use super::{Action, Runtime};
use crate::types::{Expired, ExpiryReason, Outcome, RejectReason};

/// Why a reply ended the way it did, as clients and metrics see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    QueueFull,
    TierShed,
    KvPressure,
    TtftSla,
    PreemptionBreaker,
    Draining,
    NoHealthyBackend,
    Displaced,
    RateLimited,
    QueueTimeout,
    FirstTokenTimeout,
    Deadline,
    /// The client's own deadline (`governor::Signals`) cannot be met: refused on arrival, or
    /// taken out of the queue when it passed.
    ClientDeadline,
    ClientStall,
    Shutdown,
    UpstreamError,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::QueueFull => "queue_full",
            Self::TierShed => "tier_shed",
            Self::KvPressure => "kv_pressure",
            Self::TtftSla => "ttft_sla",
            Self::PreemptionBreaker => "preemption_breaker",
            Self::Draining => "draining",
            Self::NoHealthyBackend => "no_healthy_backend",
            Self::Displaced => "displaced",
            Self::RateLimited => "rate_limited",
            Self::QueueTimeout => "queue_timeout",
            Self::FirstTokenTimeout => "first_token_timeout",
            Self::Deadline => "deadline",
            Self::ClientDeadline => "client_deadline",
            Self::ClientStall => "client_stall",
            Self::Shutdown => "shutdown",
            Self::UpstreamError => "upstream_error",
        }
    }

    pub(super) fn of_reject(reason: RejectReason) -> Self {
        match reason {
            RejectReason::QueueFull => Self::QueueFull,
            RejectReason::TierShed => Self::TierShed,
            RejectReason::KvPressure => Self::KvPressure,
            RejectReason::TtftSla => Self::TtftSla,
            RejectReason::PreemptionBreaker => Self::PreemptionBreaker,
            RejectReason::Draining => Self::Draining,
            RejectReason::NoHealthyBackend => Self::NoHealthyBackend,
            RejectReason::Displaced => Self::Displaced,
            RejectReason::RateLimited => Self::RateLimited,
            RejectReason::ClientDeadline => Self::ClientDeadline,
        }
    }

    pub(super) fn of_expiry(reason: ExpiryReason) -> Self {
        match reason {
            ExpiryReason::QueueTimeout => Self::QueueTimeout,
            ExpiryReason::FirstTokenTimeout => Self::FirstTokenTimeout,
            ExpiryReason::Deadline => Self::Deadline,
            ExpiryReason::ClientDeadline => Self::ClientDeadline,
        }
    }
}

/// A refusal as `arrive` answers it: the `Reply`'s status, reason and Retry-After.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    pub status: u16,
    pub reason: Reason,
    /// Whole seconds, as the header carries them (`wire_retry_after`).
    pub retry_after_s: u32,
}

impl Refusal {
    /// A 503 when nothing can serve (draining, no healthy backend), else a 429. That includes a
    /// client's deadline the queue cannot meet: the load, not a fault, keeps it from starting,
    /// and a 429's Retry-After (which both SDKs honour) says when its budget will suffice; a
    /// 504 would claim an upstream timed out (none was asked), and proxies retry a 5xx at once.
    pub(super) fn of(reason: RejectReason, retry_after_s: f64) -> Self {
        let status = match reason {
            RejectReason::Draining | RejectReason::NoHealthyBackend => 503,
            _ => 429,
        };
        Self {
            status,
            reason: Reason::of_reject(reason),
            retry_after_s: wire_retry_after(retry_after_s),
        }
    }
}

/// The seconds a Retry-After header carries: whole seconds (RFC 9110), at least one, rounded up
/// so a client is never told to come back before the estimate.
pub fn wire_retry_after(seconds: f64) -> u32 {
    seconds.ceil().clamp(1.0, f64::from(u32::MAX)) as u32
}

impl Runtime {
    /// End a request with `End`: upstream done, failed after commit, or the client left.
    pub(super) fn end(&mut self, id: u64, outcome: Outcome, now: u64) {
        if let Some(s) = self.sessions.forget(id) {
            if !s.upstream_done {
                self.gov.finish(id, outcome, now);
            }
            self.out.push(Action::End { id, outcome });
        }
    }

    /// End a request with `Cut` (the reply ends now with a visible notice), aborting it
    /// upstream unless upstream is done already.
    pub(super) fn cut(&mut self, id: u64, reason: Reason, outcome: Outcome, now: u64) {
        if let Some(s) = self.sessions.forget(id) {
            if !s.upstream_done {
                self.gov.finish(id, outcome, now);
                self.out.push(Action::Abort { id });
            }
            self.out.push(Action::Cut { id, reason });
        }
    }

    /// Upstream failed: a backend nothing answered is marked down; the client gets vLLM's
    /// 4xx as it came (anything else as 502), or a cut once its stream has begun.
    /// Returns whether room freed.
    pub(super) fn failed(&mut self, id: u64, status: u16, backend_down: bool, now: u64) -> bool {
        if self.sessions.get(id).is_none_or(|s| s.upstream_done) {
            return false;
        }
        let session = self.sessions.forget(id).expect("checked above");
        if backend_down {
            if let Some(backend) = self.gov.request_backend(id) {
                if self.health.unreachable(backend, now) {
                    self.set_health(backend, false);
                }
            }
        }
        self.gov.finish(id, Outcome::Error, now);
        if session.stream && session.first_token {
            // The status line is already out: report in-band, as vLLM does.
            self.out.push(Action::Cut {
                id,
                reason: Reason::UpstreamError,
            });
        } else {
            let status = if (400..500).contains(&status) {
                status
            } else {
                502
            };
            self.out.push(Action::Reply {
                id,
                status,
                reason: Reason::UpstreamError,
                retry_after_s: None,
            });
        }
        true
    }

    /// Render a deadline the governor reported (it has already ended the request).
    pub(super) fn expired(&mut self, e: &Expired) {
        let Some(session) = self.sessions.forget(e.request_id) else {
            return;
        };
        let id = e.request_id;
        let reason = Reason::of_expiry(e.reason);
        if session.started {
            self.out.push(Action::Abort { id });
        }
        let retry = Some(wire_retry_after(e.retry_after_s));
        self.out.push(match e.reason {
            // As refused on arrival (`Refusal::of`): a 429, never started.
            ExpiryReason::ClientDeadline => Action::Reply {
                id,
                status: 429,
                reason,
                retry_after_s: retry,
            },
            _ if !e.was_running => Action::Reply {
                id,
                status: 503,
                reason,
                retry_after_s: retry,
            },
            ExpiryReason::FirstTokenTimeout if self.life.first_token_error => Action::Reply {
                id,
                status: 504,
                reason,
                retry_after_s: retry,
            },
            _ => Action::Cut { id, reason },
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // A refusal goes out as 503 when nothing can serve (draining, no healthy backend), else as
    // 429, with its Retry-After in whole seconds, never below one.
    #[test]
    fn refusal_status_and_header() {
        let busy = Refusal::of(RejectReason::QueueFull, 0.2);
        let busy = (busy.status, busy.reason, busy.retry_after_s);
        assert_eq!(busy, (429, Reason::QueueFull, 1));
        let down = Refusal::of(RejectReason::NoHealthyBackend, 2.5);
        assert_eq!((down.status, down.retry_after_s), (503, 3));
        assert_eq!(Refusal::of(RejectReason::Draining, 1.0).status, 503);
        let late = Refusal::of(RejectReason::ClientDeadline, 4.2);
        assert_eq!(
            (late.status, late.reason.as_str(), late.retry_after_s),
            (429, "client_deadline", 5)
        );
        assert_eq!(wire_retry_after(f64::INFINITY), u32::MAX);
    }

    // Each reason's wire name is its serde name (metrics and the trace say the same thing).
    #[test]
    fn reason_names_match_serde() {
        for reason in RejectReason::ALL {
            let r = Reason::of_reject(reason);
            assert_eq!(serde_json::to_value(r).unwrap(), r.as_str());
        }
        for reason in ExpiryReason::ALL {
            let r = Reason::of_expiry(reason);
            assert_eq!(serde_json::to_value(r).unwrap(), r.as_str());
        }
    }
}
