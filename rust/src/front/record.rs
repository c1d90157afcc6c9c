//! What Python hears of a request the front served: one record at its end, for the metrics,
//! the access log and the OpenTelemetry spans, which stay Python's (one registry, one file,
//! one `/metrics`, one exporter).

/// One served request, as the metrics and the access log count it.
#[allow(clippy::struct_excessive_bools)] // what happened to it, each read once in Python
#[derive(Debug, Clone, Default)]
pub struct Record {
    /// Sent at its first token (the TTFT histogram hears it then), else at its end.
    pub first_token_only: bool,
    pub id: u64,
    pub tenant: String,
    pub tier: String,
    /// Monotonic microseconds (the runtime's clock) of its arrival, its start upstream, its
    /// first token, and its end.
    pub arrived_us: u64,
    pub started_us: Option<u64>,
    pub first_token_us: Option<u64>,
    pub ended_us: u64,
    pub prompt_tokens: u64,
    pub max_tokens: Option<u64>,
    pub completion_tokens: u64,
    /// The endpoint's path, whether the client asked for a stream, the served model it
    /// routes to (the span's attributes, as the Python path's `Prepared` gives them).
    pub path: &'static str,
    pub stream: bool,
    pub model: String,
    /// What the runtime's `Start` said: the time it waited in the queue, and the bound a
    /// brownout put on its output.
    pub queue_wait_us: Option<u64>,
    pub brownout_max_tokens: Option<u64>,
    /// How it ended, in the runtime's words: `completed`, or the reason of its `Reply`, `Cut`
    /// or `End` (`queue_full`, `deadline`, `client_gone`, ...).
    pub end: String,
    /// The status and code of the error it was answered with, when it was.
    pub error: Option<(u16, String)>,
    /// The Retry-After (whole seconds) the error was answered with, when it was.
    pub retry_after_s: Option<u32>,
    /// Refused as it arrived (never admitted).
    pub refused: bool,
    /// The reply was cut with a notice.
    pub truncated: bool,
    /// The upstream request started and did not finish.
    pub upstream_aborted: bool,
    pub backend: Option<String>,
    /// A split request's prefill instance (its URL) answered no `kv_transfer_params`: Python
    /// logs `prefill_hop`'s warning for it.
    pub prefill_unread: Option<String>,
    /// Its trace, while telemetry is on: the spans Python builds at its end carry these ids,
    /// and vLLM got the upstream span's as `traceparent`.
    pub trace: Option<super::traceparent::TraceIds>,
    /// Shadow mode: what the policy runtime did with it (its end's record only).
    pub shadow: Option<crate::shadow::Verdict>,
}
