//! A live request as the governor holds it, and what it holds while it runs.

use crate::types::ExpiryReason;

#[derive(Debug, Clone)]
pub(crate) struct Running {
    /// Where it holds its slot and KV and decodes.
    pub backend: u32,
    /// In a split pool, while its prefill hop runs: the prefill instance (its slot there is
    /// held until the hop answers, `Governor::prefilled`, or the request ends).
    pub prefill: Option<u32>,
    /// Its pool is split: its prompt's prefill was counted on the prefill instance.
    pub(super) split: bool,
    pub(super) admitted_us: u64,
    pub first_token: bool,
    /// Nothing else was in prefill on its backend when it started: its own time to first
    /// token then bounds the backend's prefill throughput from below.
    pub(super) prefill_alone: bool,
}

impl Running {
    /// How long its prompt took to its first token (or its prefill hop's answer) if nothing
    /// else was in prefill on its backend when it started, else 0. Only such a prompt bounds
    /// the backend's prefill throughput: under a burst each prompt shares the steps, and its
    /// own time says little.
    pub(crate) fn alone_us(&self, now_us: u64) -> u64 {
        if self.prefill_alone {
            now_us.saturating_sub(self.admitted_us)
        } else {
            0
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Request {
    pub tenant: u32,
    pub tier: usize,
    /// The model pool it waits and runs in.
    pub pool: u32,
    /// Its block hashes, kept only in a `prefix` pool (remembered where it starts).
    pub chain: Vec<u64>,
    /// In a `prefix` pool, once started: the leading blocks its backend likely held then.
    pub prefix_hits: Option<u64>,
    pub prompt: u64,
    pub max_tokens: u64,
    pub generated: u64,
    /// KV blocks this request counts against its backend while running: the larger of its
    /// expected peak (prompt plus expected output, fixed at start) and what it holds now.
    pub committed: u64,
    /// `max_tokens` after a brownout clamped it (`None`: as asked).
    pub browned_out: Option<u64>,
    pub priority: i64,
    pub submitted_us: u64,
    /// When its client first came: `submitted_us`, or earlier for a known retry.
    pub(super) first_seen_us: u64,
    pub(super) fingerprint: u64,
    /// When its SLA clock started: `first_seen_us`, or already run out at arrival for a retry
    /// its client announced that the retry memory does not hold (`Governor::seen`).
    pub(super) sla_from_us: u64,
    /// When its client gives up waiting (its honoured `Signals::deadline_us` from arrival).
    pub(super) client_deadline_us: Option<u64>,
    /// The retry count its client announced (honoured), for a refused lease's new decision.
    pub(super) retries: Option<u32>,
    pub running: Option<Running>,
    pub(super) deadlines: [Option<u64>; ExpiryReason::ALL.len()],
}
