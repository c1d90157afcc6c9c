//! The governor's counts by decision, reason and outcome, for metrics.

use crate::types::{ExpiryReason, Outcome, RejectReason};

/// Counts by decision, reason and outcome, for metrics.
///
/// A request `submit` queued and its own dispatch then started at once counts as `admitted`
/// (its decision says so), not as `queued` plus `dispatched`; other requests that dispatch
/// started count as `dispatched`, like those a host's `dispatch` call starts.
#[derive(Debug, Clone, Default)]
pub struct Counters {
    pub admitted: u64,
    pub queued: u64,
    pub dispatched: u64,
    /// Requests admitted or queued with `max_tokens` clamped by a brownout.
    pub browned_out: u64,
    /// Arrivals known as a client's retry of a request that ended unserved (`retries`).
    pub retries_known: u64,
    /// Arrivals whose client announced a retry (an honoured retry count above zero).
    pub retries_announced: u64,
    /// Queued requests that went to their tier's late lane (moved there, or arrived late).
    pub late: u64,
    pub rejected: [u64; RejectReason::ALL.len()],
    pub finished: [u64; Outcome::ALL.len()],
    pub expired: [u64; ExpiryReason::ALL.len()],
}
