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
    /// A queued request pushed out by a tenant of the same tier holding less than its fair
    /// share of the waiting places.
    Displaced,
}

impl RejectReason {
    pub const ALL: [Self; 8] = [
        Self::QueueFull,
        Self::TierShed,
        Self::KvPressure,
        Self::TtftSla,
        Self::PreemptionBreaker,
        Self::Draining,
        Self::NoHealthyBackend,
        Self::Displaced,
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
        }
    }
}

/// What `Governor::submit` decided.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Decision {
    Admitted {
        backend: u32,
        priority: i64,
    },
    Queued {
        position: u32,
        estimated_wait_s: f64,
        priority: i64,
        /// A queued request this one pushed out (same tier, tenant over its fair share of the
        /// waiting places), with its Retry-After: the caller must answer it with a 429.
        displaced: Option<(u64, f64)>,
    },
    Rejected {
        reason: RejectReason,
        retry_after_s: f64,
    },
}

/// A queued request moved onto a backend by `Governor::dispatch`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Admission {
    pub request_id: u64,
    pub backend: u32,
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ExpiryReason {
    QueueTimeout = 0,
    FirstTokenTimeout = 1,
    Deadline = 2,
}

impl ExpiryReason {
    pub const ALL: [Self; 3] = [Self::QueueTimeout, Self::FirstTokenTimeout, Self::Deadline];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::QueueTimeout => "queue_timeout",
            Self::FirstTokenTimeout => "first_token_timeout",
            Self::Deadline => "deadline",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Expired {
    pub request_id: u64,
    pub reason: ExpiryReason,
    pub was_running: bool,
    pub backend: Option<u32>,
    /// For the caller's 503/504: when a retry could expect to get through (the queue ahead
    /// drained at the current rate, plus the recent refusal backlog).
    pub retry_after_s: f64,
}
