//! One relayed stream: the upstream request, its SSE read, and the client's writes, in one task.
//!
//! Reading and writing share the task, so a chunk crosses no task boundary: each upstream
//! piece is de-framed, shaped and written to the client's socket in the same wake-up. The
//! window of unwritten chunks (`client_window`) is the backpressure: when it is full the task
//! stops reading upstream (`pause_when_full`, so TCP pushes back on vLLM) or merges overflow
//! into the newest waiting piece, and it tells the host, whose runtime runs the stall timer.
//! The task decides nothing: cuts, aborts and the end come from the runtime, via the host, as
//! [`Control`] messages.
//!
//! This file holds the task's state, its loop and the controls; `vllm` the upstream side
//! (connect, response, frames, failures), `client` the client side (the window, coalescing,
//! the writes, the end of the reply).

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::Response;
use tokio::net::TcpStream;
use tokio::sync::mpsc::UnboundedReceiver;

use super::chunk::{ChunkShaper, Ending};
use super::events::RelayEvent;
use super::responses::{EventReader, ReplyKind, Shaper};
use super::upstream::{Conn, Origin};
use super::Shared;

mod client;
mod vllm;

use client::{into_fd, Piece};
use vllm::connect;

/// What the host asks of a stream (each carries out a runtime action).
#[derive(Debug)]
pub enum Control {
    /// End the reply: stop reading upstream, write the finishing chunks still held, the
    /// ending (the notice or the error), then `[DONE]`. Without an ending (a stalled client),
    /// close the connection at once.
    Cut(Option<Ending>),
    /// Take the client's connection now, before the first token, but write nothing until
    /// the reply's first piece (its first chunk, or a cut's notice): then `head`, then it, in
    /// the same write. `keep_alive`: hand the socket back after a clean end, for the next
    /// request.
    Hold {
        socket: std::net::TcpStream,
        head: Vec<u8>,
        keep_alive: bool,
    },
    /// Give a held connection back unwritten (`Closed` carries it): the host answers with an
    /// error status instead. On a connection already written to, this is `Close`.
    GiveBack,
    /// Close the upstream request (vLLM aborts it and frees its KV blocks).
    Abort,
    /// Drop everything now: upstream and client.
    Close,
    /// Say when every control before this one has been carried out (the host waits for an
    /// abort to reach the socket before the runtime's next `Start` goes upstream).
    Ack(std::sync::mpsc::SyncSender<()>),
}

/// A request to relay.
#[allow(clippy::struct_excessive_bools)] // the reply's shape, as the client asked it
pub struct Open {
    pub id: u64,
    /// The backend: `host:port`, and TLS over https.
    pub origin: Origin,
    /// `/v1/chat/completions` or `/v1/completions`.
    pub path: String,
    pub body: Bytes,
    /// Sent as `X-Request-Id`.
    pub request_id: String,
    /// Sent as W3C `traceparent` (the gateway's upstream span), when tracing.
    pub traceparent: Option<String>,
    pub include_usage: bool,
    /// Each chunk keeps its usage (`stream_options.continuous_usage_stats`).
    pub continuous_usage: bool,
    /// The reply's choices (`n`, times the prompts of a batch).
    pub choices: u64,
    /// vLLM answers one JSON object (`RelayEvent::Answer`), not a stream.
    pub unstreamed: bool,
    /// Give the payloads to the sink, write nothing to a client (a reply not streamed).
    pub whole: bool,
    /// A hop before the stream (`Streams::hop`): the answer goes to the sink as it is, any
    /// JSON, with no `Started` and no tokens.
    pub hop: bool,
    /// Completion chunks, or Responses events (no `[DONE]`: the body's end is the reply's).
    pub kind: ReplyKind,
    /// Where its events go (the native front's task).
    pub sink: super::Sink,
}

type ResponseFuture = Pin<Box<dyn Future<Output = hyper::Result<Response<Incoming>>> + Send>>;
type ConnectFuture = Pin<Box<dyn Future<Output = io::Result<Conn>> + Send>>;

const DONE_FRAME: &[u8] = b"data: [DONE]\n\n";
/// vLLM ends the body right after `[DONE]`; waiting this long for it keeps the connection.
const BODY_END_WAIT: std::time::Duration = std::time::Duration::from_millis(50);
const ERROR_BODY_LIMIT: usize = 64 * 1024;
const WRITE_BATCH: usize = 64; // pieces per vectored write
/// The most of an unstreamed answer read (`upstream._ANSWER_LIMIT`); past it the answer is
/// cut there, and reads as JSON no more.
const ANSWER_LIMIT: usize = 16 * 1024 * 1024;

#[allow(clippy::struct_excessive_bools)] // one task's state flags, each read in one place
struct Task {
    shared: Arc<Shared>,
    id: u64,
    open: Open,
    connecting: Option<ConnectFuture>,
    /// The connection to vLLM, its driver polled by this task (dropping it closes the socket).
    conn: Option<Conn>,
    response: Option<ResponseFuture>,
    body: Option<Incoming>,
    /// `[DONE]` came; the rest of the body is read so the connection can serve again.
    draining_body: bool,
    /// How long the body's end may take after `[DONE]` before the connection is dropped.
    drain_until: Option<Instant>,
    retried: bool,
    decoder: super::sse::SseDecoder,
    shaper: Shaper,
    first_sent: bool,
    upstream_complete: bool,
    client: Option<TcpStream>,
    keep_alive: bool,
    watch_client: bool,
    /// Wire pieces not yet written (chunk-encoded frames; the head first once released).
    out: VecDeque<Piece>,
    /// Bytes of `out[0]` already written.
    written: usize,
    /// Frames in `out` (the head and the terminator do not count).
    out_frames: usize,
    /// Frames waiting for the coalescing interval.
    held: Vec<Vec<u8>>,
    flush_at: Option<tokio::time::Instant>,
    last_flush: Option<Instant>,
    last_write: Option<Instant>,
    full: bool,
    driver_done: bool,
    terminated: bool,
    clean: bool,
    /// A cut's notice was written: some choice was still open (`Closed::truncated`).
    truncated: bool,
    /// The head of a held connection (`Control::Hold`), written before its first piece.
    held_head: Option<Vec<u8>>,
    /// A held connection given back unwritten (`Control::GiveBack`).
    given_back: bool,
    /// `[DONE]` came and the host has not yet heard `Done` (it does when the body ends).
    done_pending: bool,
    /// Tokens counted since the last report (`RelayEvent::Tokens`).
    tokens: u32,
    /// When `tokens` are reported (`token_flush` after the first of them), if they wait.
    tokens_due: Option<tokio::time::Instant>,
    /// The timer of `tokens_due`, made once and reset (a chunk arms no new one).
    token_timer: Pin<Box<tokio::time::Sleep>>,
    /// An unstreamed answer's bytes so far (from its 200 to its body's end).
    answer: Option<Vec<u8>>,
}

/// Run one stream to its end; returns the event that closes it.
pub async fn run(
    shared: Arc<Shared>,
    open: Open,
    mut ctrl: UnboundedReceiver<Control>,
) -> RelayEvent {
    let connecting = Some(connect(&shared, &open.origin));
    let max_event_bytes = shared.config.max_event_bytes;
    let mut task = Task {
        id: open.id,
        // A reply assembled whole holds back no finishing chunk (its frames are not sent).
        shaper: match open.kind {
            ReplyKind::Chunks => Shaper::Chunks(ChunkShaper::shaped(
                open.include_usage || open.whole,
                open.continuous_usage,
                open.choices,
            )),
            ReplyKind::Events => Shaper::Events(EventReader::default()),
        },
        shared,
        open,
        connecting,
        conn: None,
        response: None,
        body: None,
        draining_body: false,
        drain_until: None,
        retried: false,
        decoder: super::sse::SseDecoder::with_limit(max_event_bytes),
        first_sent: false,
        upstream_complete: false,
        client: None,
        keep_alive: false,
        watch_client: false,
        out: VecDeque::new(),
        written: 0,
        out_frames: 0,
        held: Vec::new(),
        flush_at: None,
        last_flush: None,
        last_write: None,
        full: false,
        driver_done: false,
        terminated: false,
        clean: false,
        truncated: false,
        held_head: None,
        given_back: false,
        done_pending: false,
        tokens: 0,
        tokens_due: None,
        token_timer: Box::pin(tokio::time::sleep(std::time::Duration::ZERO)),
        answer: None,
    };
    task.run(&mut ctrl).await;
    task.closed()
}

enum Step {
    Go,
    Stop,
}

impl Task {
    async fn run(&mut self, ctrl: &mut UnboundedReceiver<Control>) {
        let mut peek_buf = [0u8; 1];
        loop {
            // Everything written; a reply assembled whole has no client and nothing to write.
            let written = self.terminated
                && self.out.is_empty()
                && (self.client.is_some() || self.open.whole);
            let draining = self.body.is_some() && self.draining_body;
            if written && !(draining && self.drain_until.is_some_and(|t| Instant::now() < t)) {
                return; // everything written (and the upstream body read to its end, or given up)
            }
            let reading = self.body.is_some()
                && (self.draining_body || !(self.full && self.shared.config.pause_when_full));
            let driving = self.conn.is_some() && !self.driver_done;
            let writing = self.client.is_some() && !self.out.is_empty() && self.held_head.is_none();
            let watching = self.client.is_some() && self.watch_client;
            let step = tokio::select! {
                biased;
                msg = ctrl.recv() => match msg {
                    Some(control) => self.control(control),
                    None => Step::Stop,
                },
                conn = async { self.connecting.as_mut().unwrap().await }, if self.connecting.is_some() => {
                    self.connecting = None;
                    self.on_connected(conn)
                }
                _ = async { self.conn.as_mut().unwrap().driver.as_mut().await }, if driving => {
                    // The connection ended; a reply or body still waiting on it fails by itself.
                    self.driver_done = true;
                    Step::Go
                }
                res = async { self.response.as_mut().unwrap().await }, if self.response.is_some() => {
                    self.response = None;
                    self.on_response(res).await
                }
                frame = async { self.body.as_mut().unwrap().frame().await }, if reading => {
                    self.on_frame(frame)
                }
                ready = async { self.client.as_ref().unwrap().writable().await }, if writing => {
                    match ready {
                        Ok(()) => self.write(),
                        Err(_) => self.client_gone(),
                    }
                }
                // Polled, not awaited: each turn of the loop would make and drop a readiness
                // future (two locks of the socket's waiters) for a socket that rarely speaks.
                seen = std::future::poll_fn(|cx| {
                    let mut buf = tokio::io::ReadBuf::new(&mut peek_buf);
                    self.client.as_ref().unwrap().poll_peek(cx, &mut buf)
                }), if watching => {
                    match seen {
                        Ok(0) | Err(_) => self.client_gone(),
                        Ok(_) => { self.watch_client = false; Step::Go } // pipelined bytes: not ours
                    }
                }
                () = async { tokio::time::sleep_until(self.drain_until.unwrap().into()).await }, if draining => {
                    // The body did not end in time after `[DONE]`: given up, the connection
                    // with it (it cannot serve again), and the host hears `Done`.
                    self.body = None;
                    self.conn = None;
                    self.upstream_ended();
                    Step::Go
                }
                () = async { tokio::time::sleep_until(self.flush_at.unwrap()).await }, if self.flush_at.is_some() => {
                    self.flush_held();
                    self.write()
                }
                () = self.token_timer.as_mut(), if self.tokens_due.is_some() => {
                    self.report_tokens();
                    Step::Go
                }
            };
            if matches!(step, Step::Stop) {
                return;
            }
        }
    }

    /// Send an event to the request's task, after the tokens counted before it.
    fn push(&mut self, event: RelayEvent) {
        self.report_tokens();
        let _ = self.open.sink.send(event);
    }

    /// Count tokens: they go to the request's task `token_flush` after the first of them
    /// (or with its next event, before it), so a chunk wakes nobody but this task.
    fn add_tokens(&mut self, n: u32) {
        if n == 0 {
            return;
        }
        self.tokens = self.tokens.saturating_add(n);
        if self.tokens_due.is_none() {
            let due = tokio::time::Instant::now() + self.shared.config.token_flush;
            self.tokens_due = Some(due);
            self.token_timer.as_mut().reset(due);
        }
    }

    /// The tokens counted and not yet reported, now.
    fn report_tokens(&mut self) {
        self.tokens_due = None;
        if self.tokens > 0 {
            let n = std::mem::take(&mut self.tokens);
            let _ = self.open.sink.send(RelayEvent::Tokens(self.id, n));
        }
    }

    fn closed(mut self) -> RelayEvent {
        self.upstream_ended(); // before `Closed`: a `[DONE]` the body's end never followed
        self.report_tokens();
        if let Some(conn) = self.conn.take() {
            let drained = self.upstream_complete && self.body.is_none() && !self.driver_done;
            if drained && !conn.sender.is_closed() {
                self.shared.pool.checkin(&self.open.origin, conn);
            }
        }
        let socket = if self.given_back || (self.clean && self.keep_alive && self.out.is_empty()) {
            self.client
                .take()
                .and_then(|c| c.into_std().ok())
                .map(into_fd)
        } else {
            None
        };
        RelayEvent::Closed {
            id: self.id,
            socket,
            upstream_complete: self.upstream_complete,
            completion_tokens: self.shaper.completion_tokens(),
            truncated: self.truncated,
        }
    }

    // ---- upstream --------------------------------------------------------------------------

    // ---- the client's window ---------------------------------------------------------------

    // ---- the host's controls ---------------------------------------------------------------

    fn control(&mut self, control: Control) -> Step {
        match control {
            Control::Hold {
                socket,
                head,
                keep_alive,
            } => {
                if !self.take_client(socket, keep_alive) {
                    return self.client_gone();
                }
                self.held_head = Some(head);
                if self.first_sent || self.terminated {
                    // The stream ran ahead of the lend (its task can read vLLM before the
                    // request's task gets to lend the socket): the head's moment has passed,
                    // so it goes out now, before what waits; held, it would hold it all.
                    self.release_head();
                    return self.write();
                }
                Step::Go
            }
            Control::GiveBack => {
                self.stop_upstream();
                if self.held_head.take().is_some() {
                    self.given_back = true;
                } else {
                    self.clean = false;
                }
                Step::Stop
            }
            Control::Cut(Some(ending)) => {
                self.stop_upstream();
                if !self.terminated {
                    self.flush_held();
                    let (frames, truncated) = self.shaper.cut(ending);
                    self.truncated = truncated;
                    for frame in frames {
                        self.push_frame(&frame);
                    }
                    self.terminate();
                    // The reply ends whole (the notice, `[DONE]`, the last chunk): once it is
                    // written the connection serves the client's next request, as after any
                    // reply (the head promised nothing else).
                    self.clean = true;
                }
                if self.client.is_none() {
                    return Step::Go; // written once the client's socket is lent
                }
                self.write()
            }
            Control::Cut(None) | Control::Close => {
                self.clean = false;
                self.stop_upstream();
                Step::Stop
            }
            Control::Abort => {
                self.stop_upstream();
                Step::Go
            }
            Control::Ack(done) => {
                let _ = done.send(());
                Step::Go
            }
        }
    }
}

impl Task {
    fn take_client(&mut self, socket: std::net::TcpStream, keep_alive: bool) -> bool {
        let client = socket
            .set_nonblocking(true)
            .and_then(|()| TcpStream::from_std(socket));
        let Ok(client) = client else {
            return false;
        };
        let _ = client.set_nodelay(true);
        self.client = Some(client);
        self.keep_alive = keep_alive;
        self.watch_client = true;
        true
    }
}

/// Why a started reply's body broke, in the Python path's words (`upstream.why` of what its
/// HTTP client raised), and whether that marks the backend down: a connection that reset is
/// the OS's words for its errno, one that closed mid-body `ConnectionLost` (both down: the
/// backend died under the reply); bad framing from a live backend is `ProtocolError` (up).
fn body_broke(e: &hyper::Error) -> (String, bool) {
    if framing_error(e) {
        return ("ProtocolError".to_owned(), false);
    }
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        if let Some(io) = cause.downcast_ref::<io::Error>() {
            if let Some(errno) = io.raw_os_error() {
                return (os_words(io, errno), true);
            }
        }
        source = cause.source();
    }
    ("ConnectionLost".to_owned(), true)
}

/// An OS error as Python's `os.strerror` words it: `io::Error` shows it as
/// "<strerror> (os error N)".
fn os_words(e: &io::Error, errno: i32) -> String {
    let shown = e.to_string();
    shown
        .strip_suffix(&format!(" (os error {errno})"))
        .unwrap_or(&shown)
        .to_owned()
}

/// Whether a body error is bad framing from a live backend (a chunk size that is not hex, a
/// body past its length), not a connection that closed or reset under the reply.
fn framing_error(e: &hyper::Error) -> bool {
    if e.is_incomplete_message() {
        return false;
    }
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        if let Some(io) = cause.downcast_ref::<io::Error>() {
            return matches!(
                io.kind(),
                io::ErrorKind::InvalidData | io::ErrorKind::InvalidInput
            );
        }
        source = cause.source();
    }
    e.is_parse()
}
