//! What a host tells the runtime: the events, as a trace line carries them.

use serde::{Deserialize, Serialize};

/// Something that happened, as a host saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Event {
    /// A request arrived (tenant index, prompt tokens, the most tokens it may generate), for
    /// a model pool (`Governor::pool_of`), with its prompt's chained block hashes (for prefix
    /// routing). Both are left out of a trace line when default, so older traces still read.
    Arrive {
        id: u64,
        tenant: u32,
        prompt: u64,
        max_tokens: u64,
        stream: bool,
        #[serde(default, skip_serializing_if = "is_zero")]
        pool: u32,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        chain: Vec<u64>,
        /// The host's fingerprint of the request (0: none), by which a retry is known.
        #[serde(default, skip_serializing_if = "is_zero_u64")]
        fingerprint: u64,
        /// What the client said (`governor::Signals`): the retries it made before this one,
        /// and how long it waits (ms from arrival). Left out when it said nothing.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        retries: Option<u32>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        deadline_ms: Option<u64>,
    },
    /// The backend accepted the request (response headers came back).
    Started { id: u64 },
    /// A split request's prefill hop answered (its prefill instance returned the KV transfer
    /// parameters): that instance's slot is free; the host now sends the decode hop.
    Prefilled { id: u64 },
    /// `n` more tokens were generated (the first ones count as the first token).
    Tokens { id: u64, n: u64 },
    /// Upstream finished the request.
    Done { id: u64 },
    /// Upstream failed: the status it answered (0 when unreachable), and whether the backend
    /// could not be reached at all.
    Failed {
        id: u64,
        status: u16,
        backend_down: bool,
    },
    /// The client went away.
    ClientGone { id: u64 },
    /// The client's window of unacknowledged chunks filled up.
    WindowFull { id: u64 },
    /// The client took chunks: its window has room again.
    WindowDrained { id: u64 },
    /// The host's timer fired.
    Timer,
    /// A scrape of a backend's metrics, begun at `began_us`.
    ScrapeOk {
        backend: u32,
        began_us: u64,
        kv_usage: Option<f64>,
        running: Option<u64>,
        waiting: Option<u64>,
        preemptions_total: Option<u64>,
        kv_blocks: Option<u64>,
    },
    /// A scrape of a backend failed. `reachable`: the backend answered (an error status,
    /// something that is not vLLM's metrics, or too slowly), so it is alive and only its
    /// metrics are missing; else nothing answered (no connection, or a proxy's 502-504).
    ScrapeFailed {
        backend: u32,
        #[serde(default)]
        reachable: bool,
    },
    /// Other gateway replicas hold `elsewhere` of the backend's slots and have tenants of
    /// total weight `waiting` waiting, `waiting_before` of it on the replicas ordered before
    /// this one (the shared store's figures, fed each sync; see `governor/shared.rs`).
    SharedLoad {
        backend: u32,
        elsewhere: u32,
        #[serde(default)]
        waiting: f64,
        #[serde(default)]
        waiting_before: f64,
    },
    /// The shared store refused a started request's slot lease (the global cap was reached
    /// elsewhere first): the request never reached the backend and is decided again.
    LeaseDenied { id: u64 },
    /// Other gateway replicas gave `tenant` `cost` weighted tokens of service since the last
    /// sync: its fair-queue counter counts them.
    SharedService { tenant: u32, cost: f64 },
    /// Other gateway replicas let `tenant` use `requests` and `tokens` since the last sync:
    /// its rate-limit buckets pay for them.
    SharedUsage {
        tenant: u32,
        requests: f64,
        tokens: f64,
    },
    /// Stop admitting; cut what is still live after the drain timeout.
    Drain,
    /// The shared store granted the lease a `Lease` asked for (`runtime/lease.rs`).
    LeaseGranted { id: u64 },
    /// The shared store's call for a `Lease` failed (unreachable, or too slow): the store is
    /// lost, and the request is settled as `lifecycle.leases.on_loss` says.
    LeaseFailed { id: u64 },
    /// Another call to the shared store (a sync, a release) failed: the store is lost.
    StoreLost,
    /// A sync with the shared store succeeded: `live` leases are held on the backend, this
    /// replica's among them, and other replicas have tenants of total weight `waiting`
    /// waiting, `waiting_before` of it on the replicas ordered before this one.
    StoreSynced {
        backend: u32,
        live: u32,
        #[serde(default)]
        waiting: f64,
        #[serde(default)]
        waiting_before: f64,
    },
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
fn is_zero(n: &u32) -> bool {
    *n == 0
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's `skip_serializing_if` passes a reference
fn is_zero_u64(n: &u64) -> bool {
    *n == 0
}

#[cfg(test)]
impl Event {
    /// A plain streamed arrival of 10 prompt tokens asking 10 (the unit tests' request).
    pub(crate) fn plain_arrival(id: u64, tenant: u32) -> Event {
        Event::Arrive {
            id,
            tenant,
            prompt: 10,
            max_tokens: 10,
            stream: true,
            pool: 0,
            chain: vec![],
            fingerprint: 0,
            retries: None,
            deadline_ms: None,
        }
    }
}
