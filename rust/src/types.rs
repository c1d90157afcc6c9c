//! Plain values the governor takes and returns: decisions, reasons, outcomes.

use serde::Serialize;

/// Why a request was refused. Each maps to a 429 (or 503 while draining) with a Retry-After.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RejectReason {
    QueueFull,
    TierShed,
    KvPressure,
    TtftSla,
    PreemptionBreaker,
    Draining,
    NoHealthyBackend,
    /// A queued request pushed out by a newcomer of a more important tier, or by one of its
    /// own tier whose tenant holds less than its fair share of the waiting places.
    Displaced,
    /// The tenant is over its request or token rate limit.
    RateLimited,
    /// The client said how long it waits (`Signals::deadline_us`), and the queue ahead of it
    /// would not start it within that: it would be started for nobody.
    ClientDeadline,
}

impl RejectReason {
    pub const ALL: [Self; 10] = [
        Self::QueueFull,
        Self::TierShed,
        Self::KvPressure,
        Self::TtftSla,
        Self::PreemptionBreaker,
        Self::Draining,
        Self::NoHealthyBackend,
        Self::Displaced,
        Self::RateLimited,
        Self::ClientDeadline,
    ];

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
            Self::ClientDeadline => "client_deadline",
        }
    }
}

/// What `Governor::submit` decided. Serialises flat, tagged by `kind`:
/// `{"kind": "queued", "position": 0, ...}`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Decision {
    Admitted {
        backend: u32,
        priority: i64,
        /// In a split pool: the prefill instance its prompt goes to first (`backend` decodes).
        #[serde(skip_serializing_if = "Option::is_none")]
        prefill: Option<u32>,
    },
    Queued {
        position: u32,
        estimated_wait_s: f64,
        priority: i64,
        /// A queued request this one pushed out (of a lower tier, or of its own tier's tenant
        /// furthest over its weighted share of the waiting places), with its Retry-After: the
        /// caller must answer it with a 429 (reason `displaced`).
        displaced: Option<(u64, f64)>,
    },
    Rejected {
        reason: RejectReason,
        retry_after_s: f64,
    },
}

/// A queued request moved onto a backend by `Governor::dispatch`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Admission {
    pub request_id: u64,
    pub backend: u32,
    /// In a split pool: the prefill instance its prompt goes to first.
    pub prefill: Option<u32>,
    pub priority: i64,
    pub queue_wait_us: u64,
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Completed,
    Error,
    Timeout,
    Cancelled,
}

impl Outcome {
    pub const ALL: [Self; 4] = [Self::Completed, Self::Error, Self::Timeout, Self::Cancelled];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Completed => "completed",
            Self::Error => "error",
            Self::Timeout => "timeout",
            Self::Cancelled => "cancelled",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|o| o.as_str() == text)
    }
}

/// Which deadline a request missed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpiryReason {
    QueueTimeout = 0,
    FirstTokenTimeout = 1,
    Deadline = 2,
    /// A queued request's client deadline passed: its client has given up waiting.
    ClientDeadline = 3,
}

impl ExpiryReason {
    pub const ALL: [Self; 4] = [
        Self::QueueTimeout,
        Self::FirstTokenTimeout,
        Self::Deadline,
        Self::ClientDeadline,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::QueueTimeout => "queue_timeout",
            Self::FirstTokenTimeout => "first_token_timeout",
            Self::Deadline => "deadline",
            Self::ClientDeadline => "client_deadline",
        }
    }
}

/// A request `Governor::expire` ended because one of its deadlines passed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Expired {
    pub request_id: u64,
    pub reason: ExpiryReason,
    pub was_running: bool,
    pub backend: Option<u32>,
    /// For the caller's 503/504: when a retry could expect to get through (the queue ahead
    /// drained at the current rate, plus the recent refusal backlog).
    pub retry_after_s: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(value: &impl Serialize) -> String {
        serde_json::to_string(value).unwrap()
    }

    // Each name serialises as its `as_str`, so traces, snapshots and Python agree.
    #[test]
    fn names_match_as_str() {
        for r in RejectReason::ALL {
            assert_eq!(json(&r), format!("\"{}\"", r.as_str()));
        }
        for o in Outcome::ALL {
            assert_eq!(json(&o), format!("\"{}\"", o.as_str()));
        }
        for e in ExpiryReason::ALL {
            assert_eq!(json(&e), format!("\"{}\"", e.as_str()));
        }
    }

    // Decisions serialise flat, tagged by kind.
    #[test]
    fn decision_is_tagged() {
        let d = Decision::Queued {
            position: 1,
            estimated_wait_s: 0.5,
            priority: 1000,
            displaced: Some((7, 0.25)),
        };
        assert_eq!(
            serde_json::to_string(&d).unwrap(),
            r#"{"kind":"queued","position":1,"estimated_wait_s":0.5,"priority":1000,"displaced":[7,0.25]}"#
        );
    }
}
