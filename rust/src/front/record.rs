//! A request the front served, as it is counted: one record at its first token and one at its
//! end. The front counts them in the gateway's tally and writes their access-log rows itself
//! (`crate::tally`, the same the Python path's sessions count in); Python hears of the end's
//! record only when it has work with it: the OpenTelemetry spans, which stay Python's (one
//! exporter), and the warning of a split request's prefill hop.

use crate::tally::{Ended, Refused, Tally};

/// One served request, as the tally and the spans read it.
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

impl Record {
    /// Count its end in `tally` (and write its access-log row), as the Python path counts a
    /// session: a refusal as it arrived by its code; else its cut, its aborted upstream
    /// request, and its end.
    pub fn count(&self, tally: &Tally) {
        let seconds = |us: u64| us as f64 / 1e6;
        let request = Some(format!("llmflow-{}", self.id));
        let arrived_s = seconds(self.arrived_us);
        let ended_s = (self.ended_us != 0).then(|| seconds(self.ended_us));
        if let (true, Some((status, code))) = (self.refused, &self.error) {
            tally.refused(&Refused {
                request,
                tier: self.tier.clone(),
                tenant: self.tenant.clone(),
                arrived_s,
                at_s: ended_s,
                prompt_tokens: self.prompt_tokens,
                max_tokens: self.max_tokens,
                status: *status,
                code: code.clone(),
            });
            return;
        }
        if self.truncated {
            tally.truncated(&self.end);
        }
        if self.upstream_aborted {
            tally.upstream_aborted(&self.end);
        }
        tally.ended(&Ended {
            request,
            tier: self.tier.clone(),
            tenant: self.tenant.clone(),
            arrived_s,
            queue_wait_s: self.queue_wait_us.map(seconds),
            first_token_s: self.first_token_us.map(seconds),
            ended_s,
            prompt_tokens: self.prompt_tokens,
            max_tokens: self.max_tokens,
            completion_tokens: self.completion_tokens,
            end: self.end.clone(),
            error_status: self.error.as_ref().map(|(status, _)| *status),
            backend: self.backend.clone(),
            shadow: self.shadow.as_ref().map(crate::shadow::Verdict::summary),
        });
    }
}
