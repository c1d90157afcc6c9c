//! What the runtime asks a host to do.

use serde::Serialize;

use super::Reason;
use crate::types::Outcome;

/// What a host must do.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Send the request to `backend` with vLLM priority `priority` (and, after a brownout,
    /// with `max_tokens` clamped to this). With `prefill` (a split pool), send it there
    /// first as vLLM's prefill hop (`max_tokens` 1, asking for remote decode), report
    /// `Prefilled`, then send it to `backend` with the KV transfer parameters the prefill
    /// answered.
    Start {
        id: u64,
        backend: u32,
        priority: i64,
        queue_wait_us: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        max_tokens: Option<u64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        prefill: Option<PrefillHop>,
    },
    /// The request waits in the gateway's queue (informational: keep the client waiting).
    Queued {
        id: u64,
        position: u32,
        estimated_wait_s: f64,
    },
    /// Close the upstream request now: vLLM aborts it and frees its KV blocks.
    Abort { id: u64 },
    /// Terminal: answer with this status; `retry_after_s` is the header's value, as sent.
    Reply {
        id: u64,
        status: u16,
        reason: Reason,
        retry_after_s: Option<u32>,
    },
    /// Terminal: end the reply now with the partial text and a visible notice.
    Cut { id: u64, reason: Reason },
    /// Terminal: the request is over (upstream done or failed after the reply was committed,
    /// or the client left).
    End { id: u64, outcome: Outcome },
    /// (Re)set the host's one timer to fire at `at_us`. It may fire early (nothing is due then
    /// and the runtime arms it again); it must not fire late.
    Arm { at_us: u64 },
    /// A backend went down or came back.
    Backend { backend: u32, healthy: bool },
    /// Ask the shared store for a lease on one of `backend`'s slots, granted only while fewer
    /// than `cap` are held (atomically, across replicas); feed back `LeaseGranted`,
    /// `LeaseDenied` or `LeaseFailed`. The request's `Start` follows the grant.
    Lease { id: u64, backend: u32, cap: u32 },
    /// Give the request's lease on `backend` back to the shared store (it ended).
    Release { id: u64, backend: u32 },
}

/// A split request's prefill hop: where it goes first, and with which vLLM priority.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PrefillHop {
    pub backend: u32,
    pub priority: i64,
}

impl Action {
    /// Whether this action ends its request.
    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            Self::Reply { .. } | Self::Cut { .. } | Self::End { .. }
        )
    }
}
