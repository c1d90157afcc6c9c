//! What a relayed stream tells the task that serves its request (through the stream's sink).

/// An upstream failure, as the client should hear it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The status to answer with (4xx passed through, 502).
    pub status: u16,
    /// `backend_unavailable`, `backend_rejected`, `backend_error`.
    pub code: &'static str,
    pub message: String,
    /// The backend could not be reached at all.
    pub backend_down: bool,
    /// The error object a backend's 4xx carried (`{"message","type","param","code"}`, as
    /// JSON): the client's mistake, which it hears in vLLM's own words.
    pub error: Option<String>,
}

impl Failure {
    /// A failure of the backend's own (502), with no error object to pass on.
    pub fn backend(code: &'static str, message: String, backend_down: bool) -> Self {
        Self {
            status: 502,
            code,
            message,
            backend_down,
            error: None,
        }
    }
}

/// One thing that happened to a relayed stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RelayEvent {
    /// Upstream answered 200: the request runs in vLLM.
    Started(u64),
    /// The first generated tokens; `template` is the reply's `{"id","created","model"}`.
    FirstToken {
        id: u64,
        n: u32,
        template: Option<String>,
    },
    /// Tokens generated since the last report: the stream tallies them and hands them over
    /// at most every `token_flush`, and always before any other event of its own.
    Tokens(u64, u32),
    /// One `data:` payload of a stream opened `whole`, after its tokens were counted: the
    /// host assembles the reply (a client that did not ask for a stream).
    Payload(u64, Vec<u8>),
    /// The whole answer of a request sent unstreamed (prompt logprobs), read to its end: a
    /// JSON object, its tokens reported before it (`Started`, then `Tokens`, then this).
    Answer(u64, Vec<u8>),
    /// Upstream sent `[DONE]` and its body ended (or was given up on after it).
    Done(u64),
    /// Upstream failed (before or after the first token).
    Failed(u64, Failure),
    /// The client's window of unwritten chunks is full.
    WindowFull(u64),
    /// A full window has room again.
    WindowDrained(u64),
    /// The client closed its connection.
    ClientGone(u64),
    /// The stream is over; `socket` is the client's connection, handed back for its next
    /// request (a reply that ended cleanly on a keep-alive connection), else closed.
    Closed {
        id: u64,
        socket: Option<i32>,
        upstream_complete: bool,
        /// Tokens the stream counted in all (the host's metrics read it here, not per batch).
        completion_tokens: u64,
        /// A cut's notice went out: some choice was still open when the reply was cut (one
        /// whose choices had all finished ends as it was, and was not truncated).
        truncated: bool,
    },
}
