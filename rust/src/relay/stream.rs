//! One relayed stream: the upstream request, its SSE read, and the client's writes, in one task.
//!
//! Reading and writing share the task, so a chunk crosses no task boundary: each upstream
//! piece is de-framed, shaped and written to the client's socket in the same wake-up. The
//! window of unwritten chunks (`client_window`) is the backpressure: when it is full the task
//! stops reading upstream (`pause_when_full`, so TCP pushes back on vLLM) or merges overflow
//! into the newest waiting piece, and it tells the host, whose runtime runs the stall timer.
//! The task decides nothing: cuts, aborts and the end come from the runtime, via the host, as
//! [`Control`] messages.

use std::collections::VecDeque;
use std::future::Future;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::Response;
use tokio::net::TcpStream;
use tokio::sync::mpsc::UnboundedReceiver;

use super::chunk::{merge_frames, ChunkShaper};
use super::events::{Failure, RelayEvent};
use super::upstream::{Conn, Driver, Pool};
use super::Shared;

/// What the host asks of a stream (each carries out a runtime action).
#[derive(Debug)]
pub enum Control {
    /// Take over the client's connection (after the first token): write `head`, then the
    /// chunks. `keep_alive`: hand the socket back after a clean end, for the next request.
    Attach {
        socket: std::net::TcpStream,
        head: Vec<u8>,
        keep_alive: bool,
    },
    /// End the reply: stop reading upstream, write `frame` (the notice or the error; when
    /// `only_if_open`, only if the choice has not finished), then `[DONE]`. Without a frame
    /// (a stalled client), close the connection at once.
    Cut {
        frame: Option<Vec<u8>>,
        only_if_open: bool,
    },
    /// Close the upstream request (vLLM aborts it and frees its KV blocks).
    Abort,
    /// Drop everything now: upstream and client.
    Close,
    /// Send the request upstream now (a stream opened `deferred` waits for this).
    Go,
    /// Say when every control before this one has been carried out (the host waits for an
    /// abort to reach the socket before the runtime's next `Start` goes upstream).
    Ack(std::sync::mpsc::SyncSender<()>),
}

/// A request to relay.
pub struct Open {
    pub id: u64,
    /// The backend, `host:port`.
    pub authority: String,
    /// `/v1/chat/completions` or `/v1/completions`.
    pub path: String,
    pub body: Bytes,
    /// Sent as `X-Request-Id`.
    pub request_id: String,
    /// Sent as W3C `traceparent` (the gateway's upstream span), when tracing.
    pub traceparent: Option<String>,
    pub include_usage: bool,
    /// Wait for `Control::Go` before connecting (controls that come first still apply).
    pub deferred: bool,
}

type ResponseFuture = Pin<Box<dyn Future<Output = hyper::Result<Response<Incoming>>> + Send>>;
type ConnectFuture = Pin<Box<dyn Future<Output = io::Result<Conn>> + Send>>;

const DONE_FRAME: &[u8] = b"data: [DONE]\n\n";
/// vLLM ends the body right after `[DONE]`; waiting this long for it keeps the connection.
const BODY_END_WAIT: std::time::Duration = std::time::Duration::from_millis(50);
const ERROR_BODY_LIMIT: usize = 64 * 1024;
const WRITE_BATCH: usize = 64; // pieces per vectored write

#[allow(clippy::struct_excessive_bools)] // one task's state flags, each read in one place
struct Task {
    shared: Arc<Shared>,
    id: u64,
    open: Open,
    /// Opened deferred and not yet told to go.
    waiting_go: bool,
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
    shaper: ChunkShaper,
    first_sent: bool,
    upstream_complete: bool,
    client: Option<TcpStream>,
    keep_alive: bool,
    watch_client: bool,
    /// Wire pieces not yet written (chunk-encoded frames; the head first once attached).
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
}

/// Run one stream to its end; returns the event that closes it.
pub async fn run(
    shared: Arc<Shared>,
    open: Open,
    mut ctrl: UnboundedReceiver<Control>,
) -> RelayEvent {
    let connecting = (!open.deferred).then(|| connect(&shared, &open.authority));
    let max_event_bytes = shared.config.max_event_bytes;
    let mut task = Task {
        waiting_go: open.deferred,
        id: open.id,
        shaper: ChunkShaper::new(open.include_usage),
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
            let written = self.terminated && self.out.is_empty() && self.client.is_some();
            let draining = self.body.is_some() && self.draining_body;
            if written && !(draining && self.drain_until.is_some_and(|t| Instant::now() < t)) {
                return; // everything written (and the upstream body read to its end, or given up)
            }
            let reading = self.body.is_some()
                && (self.draining_body || !(self.full && self.shared.config.pause_when_full));
            let driving = self.conn.is_some() && !self.driver_done;
            let writing = self.client.is_some() && !self.out.is_empty();
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
                seen = async { self.client.as_ref().unwrap().peek(&mut peek_buf).await }, if watching => {
                    match seen {
                        Ok(0) | Err(_) => self.client_gone(),
                        Ok(_) => { self.watch_client = false; Step::Go } // pipelined bytes: not ours
                    }
                }
                () = async { tokio::time::sleep_until(self.drain_until.unwrap().into()).await }, if written && draining => {
                    Step::Go
                }
                () = async { tokio::time::sleep_until(self.flush_at.unwrap()).await }, if self.flush_at.is_some() => {
                    self.flush_held();
                    self.write()
                }
            };
            if matches!(step, Step::Stop) {
                return;
            }
        }
    }

    fn push(&self, event: RelayEvent) {
        self.shared.events.push(self.id, event);
    }

    fn closed(mut self) -> RelayEvent {
        if let Some(conn) = self.conn.take() {
            let drained = self.upstream_complete && self.body.is_none() && !self.driver_done;
            if drained && !conn.sender.is_closed() {
                self.shared.pool.checkin(&self.open.authority, conn);
            }
        }
        let socket = if self.clean && self.keep_alive && self.out.is_empty() {
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
        }
    }

    // ---- upstream --------------------------------------------------------------------------

    fn on_connected(&mut self, conn: io::Result<Conn>) -> Step {
        let mut conn = match conn {
            Ok(conn) => conn,
            Err(e) => {
                self.push(RelayEvent::Failed(
                    self.id,
                    Failure::backend(
                        "backend_unavailable",
                        format!("backend unreachable: {e}"),
                        true,
                    ),
                ));
                return Step::Go;
            }
        };
        let o = &self.open;
        let mut request = hyper::Request::post(o.path.as_str())
            .header("host", o.authority.as_str())
            .header("content-type", "application/json")
            .header("accept", "text/event-stream")
            .header("x-request-id", o.request_id.as_str());
        if let Some(traceparent) = &o.traceparent {
            request = request.header("traceparent", traceparent.as_str());
        }
        let request = request
            .body(Full::new(o.body.clone()))
            .expect("checked when the stream was opened");
        self.response = Some(Box::pin(conn.sender.send_request(request)));
        self.driver_done = false;
        self.conn = Some(conn);
        Step::Go
    }

    async fn on_response(&mut self, res: hyper::Result<Response<Incoming>>) -> Step {
        let response = match res {
            Ok(r) => r,
            Err(e) => {
                let stale = self.conn.as_ref().is_some_and(|c| c.reused);
                self.conn = None;
                if stale && !self.retried {
                    // A kept-alive connection the backend had closed: once more, on a new one.
                    self.retried = true;
                    self.connecting = Some(connect_new(&self.shared, &self.open.authority));
                    return Step::Go;
                }
                self.push(RelayEvent::Failed(
                    self.id,
                    Failure::backend(
                        "backend_error",
                        format!("backend failed: {}", source_chain(&e)),
                        false,
                    ),
                ));
                return Step::Go;
            }
        };
        let status = response.status().as_u16();
        if status != 200 {
            let raw = match self.conn.as_mut() {
                Some(conn) => {
                    read_limited(response.into_body(), &mut conn.driver, ERROR_BODY_LIMIT).await
                }
                None => Vec::new(),
            };
            self.conn = None; // an error reply: the connection is not worth keeping
            let message =
                error_message(&raw).unwrap_or_else(|| format!("backend answered {status}"));
            let failure = if (400..500).contains(&status) {
                Failure {
                    status,
                    code: "backend_rejected",
                    message,
                    backend_down: false,
                    error: error_object(&raw),
                }
            } else {
                Failure::backend(
                    "backend_error",
                    format!("backend error {status}: {message}"),
                    false,
                )
            };
            self.push(RelayEvent::Failed(self.id, failure));
            return Step::Go;
        }
        self.body = Some(response.into_body());
        self.shared.events.push_quiet(RelayEvent::Started(self.id));
        Step::Go
    }

    fn on_frame(&mut self, frame: Option<Result<hyper::body::Frame<Bytes>, hyper::Error>>) -> Step {
        if self.draining_body {
            match frame {
                Some(Ok(_)) => {}
                Some(Err(_)) => {
                    self.body = None;
                    self.conn = None;
                }
                None => self.body = None, // read to the end: the connection can serve again
            }
            return Step::Go;
        }
        let data = match frame {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => data,
                Err(_) => return Step::Go, // trailers
            },
            // The connection died under a started reply (a killed backend): down until a
            // scrape begun later says otherwise, so new requests go elsewhere at once. A body
            // the backend framed wrong is this reply's failure, not the backend's absence.
            Some(Err(e)) => {
                let down = !framing_error(&e);
                return self.fail(format!("backend stream broke: {e}"), down);
            }
            None => return self.fail("backend stream ended without [DONE]".to_owned(), false),
        };
        let decoded = self.decoder.feed(&data);
        let now = Instant::now();
        for payload in decoded.payloads {
            match self.shaper.feed(&payload) {
                Ok(shaped) => {
                    if shaped.new_tokens > 0 {
                        if self.first_sent {
                            self.shared.events.add_tokens(self.id, shaped.new_tokens);
                        } else {
                            self.first_sent = true;
                            self.push(RelayEvent::FirstToken {
                                id: self.id,
                                n: shaped.new_tokens,
                                template: self.shaper.template.clone(),
                            });
                        }
                    }
                    if let Some(frame) = shaped.frame {
                        self.add_frame(frame, now);
                    }
                }
                Err(failure) => return self.fail_with(failure),
            }
        }
        if decoded.too_large {
            let limit = self.shared.config.max_event_bytes;
            return self.fail(
                format!("backend sent an SSE event over {limit} bytes"),
                false,
            );
        }
        if decoded.done {
            if let Some(frame) = self.shaper.take_held() {
                self.add_frame(frame, now);
            }
            self.draining_body = true;
            self.drain_until = Some(now + BODY_END_WAIT);
            self.upstream_complete = true;
            self.clean = true;
            self.push(RelayEvent::Done(self.id));
            self.terminate();
        }
        self.write()
    }

    fn fail(&mut self, message: String, backend_down: bool) -> Step {
        self.fail_with(Failure::backend("backend_error", message, backend_down))
    }

    fn fail_with(&mut self, failure: Failure) -> Step {
        self.body = None;
        self.conn = None;
        self.push(RelayEvent::Failed(self.id, failure));
        Step::Go
    }

    // ---- the client's window ---------------------------------------------------------------

    fn occupancy(&self) -> usize {
        self.held.len() + self.out_frames
    }

    fn add_frame(&mut self, frame: Vec<u8>, now: Instant) {
        let interval = self.shared.config.flush_interval;
        if interval.is_zero() {
            self.enqueue(&frame);
        } else if self.held.is_empty()
            && self
                .last_flush
                .is_none_or(|t| now.duration_since(t) >= interval)
        {
            self.last_flush = Some(now);
            self.enqueue(&frame);
        } else {
            self.held.push(frame);
            if self.flush_at.is_none() {
                let due = self.last_flush.unwrap_or(now) + interval;
                self.flush_at = Some(tokio::time::Instant::from_std(due));
            }
        }
        self.check_full();
    }

    fn enqueue(&mut self, frame: &[u8]) {
        let cap = self.shared.config.client_window;
        if !self.shared.config.pause_when_full && self.occupancy() >= cap {
            // Merge into the newest waiting piece: the count stays bounded; the bytes are
            // bounded by the request's max_tokens.
            let writing_front = self.out.len() == 1 && self.written > 0;
            if let Some(last) = self.out.back_mut().filter(|p| p.frame && !writing_front) {
                last.bytes.extend_from_slice(&chunked(frame));
                return;
            }
        }
        self.push_frame(frame);
    }

    fn push_frame(&mut self, frame: &[u8]) {
        self.out.push_back(Piece {
            bytes: chunked(frame),
            frame: true,
        });
        self.out_frames += 1;
    }

    fn flush_held(&mut self) {
        self.flush_at = None;
        if self.held.is_empty() {
            return;
        }
        self.last_flush = Some(Instant::now());
        let held = std::mem::take(&mut self.held);
        for frame in merge_frames(held) {
            self.push_frame(&frame);
        }
    }

    fn check_full(&mut self) {
        let cap = self.shared.config.client_window;
        let occupied = self.occupancy();
        if !self.full && occupied >= cap {
            self.full = true;
            self.push(RelayEvent::WindowFull(self.id));
        } else if self.full && occupied < cap {
            self.full = false;
            self.push(RelayEvent::WindowDrained(self.id));
        }
    }

    /// `[DONE]` and the end of the chunked body, after whatever is held.
    fn terminate(&mut self) {
        if self.terminated {
            return;
        }
        self.flush_held();
        let mut tail = chunked(DONE_FRAME);
        tail.extend_from_slice(b"0\r\n\r\n");
        self.out.push_back(Piece {
            bytes: tail,
            frame: false,
        });
        self.terminated = true;
    }

    /// Write what the socket takes now, without waiting.
    fn write(&mut self) -> Step {
        let Some(client) = self.client.as_ref() else {
            return Step::Go;
        };
        while !self.out.is_empty() {
            let slices: Vec<IoSlice<'_>> = self
                .out
                .iter()
                .take(WRITE_BATCH)
                .enumerate()
                .map(|(i, piece)| {
                    IoSlice::new(if i == 0 {
                        &piece.bytes[self.written..]
                    } else {
                        &piece.bytes
                    })
                })
                .collect();
            match client.try_write_vectored(&slices) {
                Ok(0) => return self.client_gone(),
                Ok(mut n) => {
                    let now = Instant::now();
                    if let Some(last) = self.last_write {
                        self.shared.stats.observe_gap(now.duration_since(last));
                    }
                    self.last_write = Some(now);
                    while n > 0 {
                        let left = self.out[0].bytes.len() - self.written;
                        if n >= left {
                            n -= left;
                            self.written = 0;
                            if self.out.pop_front().is_some_and(|p| p.frame) {
                                self.out_frames -= 1;
                            }
                        } else {
                            self.written += n;
                            n = 0;
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => return self.client_gone(),
            }
        }
        self.check_full();
        Step::Go
    }

    fn client_gone(&mut self) -> Step {
        // Close upstream before the host hears of it: vLLM sees the abort before the runtime
        // can start another request in the freed slot.
        self.stop_upstream();
        self.client = None;
        self.clean = false;
        self.push(RelayEvent::ClientGone(self.id));
        Step::Stop
    }

    // ---- the host's controls ---------------------------------------------------------------

    fn control(&mut self, control: Control) -> Step {
        match control {
            Control::Attach {
                socket,
                head,
                keep_alive,
            } => {
                let client = socket
                    .set_nonblocking(true)
                    .and_then(|()| TcpStream::from_std(socket));
                let Ok(client) = client else {
                    return self.client_gone();
                };
                let _ = client.set_nodelay(true);
                self.client = Some(client);
                self.keep_alive = keep_alive;
                self.watch_client = true;
                self.out.push_front(Piece {
                    bytes: head,
                    frame: false,
                });
                self.write()
            }
            Control::Cut {
                frame: Some(frame),
                only_if_open,
            } => {
                self.stop_upstream();
                if !self.terminated {
                    self.clean = false;
                    self.flush_held();
                    if let Some(last) = self.shaper.take_held() {
                        self.push_frame(&last);
                    }
                    if !only_if_open || !self.shaper.finished {
                        self.push_frame(&frame);
                    }
                    self.terminate();
                }
                if self.client.is_none() {
                    return Step::Go; // written once the client is attached
                }
                self.write()
            }
            Control::Cut { frame: None, .. } | Control::Close => {
                self.clean = false;
                self.stop_upstream();
                Step::Stop
            }
            Control::Abort => {
                self.stop_upstream();
                Step::Go
            }
            Control::Go => {
                if self.waiting_go {
                    self.waiting_go = false;
                    self.connecting = Some(connect(&self.shared, &self.open.authority));
                }
                Step::Go
            }
            Control::Ack(done) => {
                let _ = done.send(());
                Step::Go
            }
        }
    }

    fn stop_upstream(&mut self) {
        if self.upstream_complete && self.draining_body {
            return; // the reply is whole: let the connection finish and serve again
        }
        self.waiting_go = false;
        self.connecting = None;
        self.response = None;
        self.body = None;
        self.conn = None; // closes the socket now, in this task
    }
}

/// Bytes waiting for the client's socket.
struct Piece {
    bytes: Vec<u8>,
    /// A chunk of the reply (counts in the window), not the head or the end.
    frame: bool,
}

/// One HTTP/1.1 chunk carrying `data`.
fn chunked(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() + 12);
    out.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
    out
}

#[cfg(unix)]
fn into_fd(socket: std::net::TcpStream) -> i32 {
    use std::os::fd::IntoRawFd;
    socket.into_raw_fd()
}

fn source_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Up to `limit` bytes of an error reply's body (the connection's driver runs meanwhile).
async fn read_limited(mut body: Incoming, driver: &mut Driver, limit: usize) -> Vec<u8> {
    let mut raw = Vec::new();
    let mut driving = true;
    while raw.len() < limit {
        tokio::select! {
            frame = body.frame() => match frame {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        raw.extend_from_slice(&data);
                    }
                }
                _ => break,
            },
            _ = driver.as_mut(), if driving => driving = false,
        }
    }
    raw.truncate(limit);
    raw
}

fn connect(shared: &Arc<Shared>, authority: &str) -> ConnectFuture {
    let shared = Arc::clone(shared);
    let authority = authority.to_owned();
    Box::pin(async move {
        let timeout = shared.config.connect_timeout;
        shared.pool.checkout(&authority, timeout).await
    })
}

/// A fresh connection (the retry after a stale kept-alive one).
fn connect_new(shared: &Arc<Shared>, authority: &str) -> ConnectFuture {
    let timeout = shared.config.connect_timeout;
    let authority = authority.to_owned();
    Box::pin(async move { Pool::connect(&authority, timeout).await })
}

/// The message of an OpenAI- or FastAPI-style error body, else its text.
fn error_message(raw: &[u8]) -> Option<String> {
    let text = match serde_json::from_slice::<serde_json::Value>(raw) {
        Ok(body) => match body.get("error") {
            Some(serde_json::Value::Object(e)) => {
                e.get("message").map(value_text).unwrap_or_default()
            }
            Some(other) if !other.is_null() => value_text(other),
            _ => body.get("message").map(value_text).unwrap_or_default(),
        },
        Err(_) => String::from_utf8_lossy(&raw[..raw.len().min(500)])
            .trim()
            .to_owned(),
    };
    (!text.is_empty()).then_some(text)
}

/// The `error` object of an OpenAI-style error body, as JSON text (what vLLM's 4xx says).
fn error_object(raw: &[u8]) -> Option<String> {
    let body = serde_json::from_slice::<serde_json::Value>(raw).ok()?;
    body.get("error")
        .filter(|e| e.is_object())
        .map(serde_json::Value::to_string)
}

fn value_text(v: &serde_json::Value) -> String {
    v.as_str().map_or_else(|| v.to_string(), str::to_owned)
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
