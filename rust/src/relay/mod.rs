//! The per-chunk relay: streams bytes from vLLM to clients on threads of its own.
//!
//! The front door's native path (`front/governed.rs`) admits a request and, when the runtime
//! says `Start`, opens it here ([`Relay::open`]). From then on every upstream chunk is read,
//! de-framed, shaped (usage cut, tokens counted) and written to the client's socket by one task
//! on the relay's tokio threads; the request's task hears a handful of events ([`RelayEvent`]:
//! started, first token, batched token counts, done, window full/drained, client gone, closed,
//! through its sink) and carries out
//! the runtime's answers to them as [`Control`]s. The relay is I/O only: it reads clocks and
//! sockets and decides nothing (no admission, deadline, stall or health rule lives here; the
//! runtime keeps them all).
//!
//! The client's connection is lent to the stream, which writes the head and the chunks
//! itself, and hands the socket back after a clean end so the client's keep-alive connection
//! goes on serving.

pub mod chunk;
pub mod events;
pub mod responses;
pub mod sse;
pub mod stream;
pub mod upstream;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use rustc_hash::FxHashMap;
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};

pub use chunk::Ending;
pub use events::{Failure, RelayEvent};
pub use responses::ReplyKind;
pub use sse::DEFAULT_MAX_EVENT_BYTES;
pub use stream::Control;

/// How streams are relayed (the gateway's `backpressure` and `streaming` settings).
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// Threads running streams (`llmflow serve --workers`).
    pub threads: usize,
    /// Unwritten chunks a client may owe before its window is full.
    pub client_window: usize,
    /// Stop reading upstream while the window is full (else merge overflow).
    pub pause_when_full: bool,
    /// Coalescing interval (`streaming.sse_flush_interval`); zero writes every chunk at once.
    pub flush_interval: Duration,
    /// How often a stream hands its token counts to its request's task.
    pub token_flush: Duration,
    /// Giving up on connecting to a backend.
    pub connect_timeout: Duration,
    /// The largest SSE event a backend may send (`server.max_event_bytes`); past it the
    /// stream fails (502), holding no more than this.
    pub max_event_bytes: usize,
}

/// Gaps between writes to a client, as a Prometheus histogram (the bounds of
/// `llmflow_inter_chunk_seconds`).
pub const GAP_BOUNDS_S: [f64; 12] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

/// Counters the host reads when `/metrics` is scraped.
#[derive(Default)]
pub struct Stats {
    gap_buckets: [AtomicU64; GAP_BOUNDS_S.len() + 1],
    gap_sum_ns: AtomicU64,
}

impl Stats {
    fn observe_gap(&self, gap: Duration) {
        let s = gap.as_secs_f64();
        let i = GAP_BOUNDS_S
            .iter()
            .position(|&b| s <= b)
            .unwrap_or(GAP_BOUNDS_S.len());
        self.gap_buckets[i].fetch_add(1, Ordering::Relaxed);
        self.gap_sum_ns
            .fetch_add(gap.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Per-bucket counts (not cumulative; the last is +Inf) and the sum in seconds.
    pub fn gaps(&self) -> (Vec<u64>, f64) {
        let counts = self
            .gap_buckets
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect();
        (counts, self.gap_sum_ns.load(Ordering::Relaxed) as f64 / 1e9)
    }
}

/// What every stream task shares.
pub struct Shared {
    pub pool: upstream::Pool,
    pub config: RelayConfig,
    pub stats: Stats,
}

/// Where a stream's events go: the task of the native front that serves the request.
pub type Sink = tokio::sync::mpsc::UnboundedSender<RelayEvent>;

/// A streamed completion to relay: the request's head and body, and how to relay it.
#[allow(clippy::struct_excessive_bools)] // the reply's shape, as the client asked it
pub struct StreamRequest<'a> {
    /// The host's id of the request (its events and controls name it).
    pub id: u64,
    /// The backend's completion URL (http or https).
    pub url: &'a str,
    /// An https backend's TLS (its `tls_ca_file` roots, its `tls_client_cert`); None: the
    /// Mozilla roots and no client certificate.
    pub tls: Option<&'a upstream::Tls>,
    pub body: Vec<u8>,
    /// Sent upstream as `X-Request-Id`.
    pub request_id: &'a str,
    /// Sent upstream as W3C `traceparent` (OpenTelemetry).
    pub traceparent: Option<&'a str>,
    /// The client asked for the usage chunk (else it is cut from the stream).
    pub include_usage: bool,
    /// The client asked for `continuous_usage_stats`: each chunk keeps its usage.
    pub continuous_usage: bool,
    /// The reply's choices (`n`, times the prompts of a batch): a cut's notice names those
    /// still open.
    pub choices: u64,
    /// Sent as it is, unstreamed: vLLM answers one JSON object, which goes to the sink whole
    /// (`RelayEvent::Answer`; the request asked for prompt logprobs). Implies `whole`.
    pub unstreamed: bool,
    /// Give each payload to the sink (`RelayEvent::Payload`) instead of writing chunks to a
    /// client: the host assembles a reply not streamed.
    pub whole: bool,
    /// Completion chunks, or Responses events (`responses.rs`).
    pub kind: ReplyKind,
    /// Its events go here, each as it happens (token counts batched).
    pub sink: Sink,
}

/// A request sent before a stream, its answer read whole (P/D's prefill hop,
/// `upstream.post_json`): no client, no token counted, no `Started`; its events are the
/// answer's raw bytes (`RelayEvent::Answer`, whatever JSON it is), or its failure, then
/// `Closed`. It is live under `id` until then, so the controls that reach a stream (an abort,
/// a close) reach it too.
pub struct HopRequest<'a> {
    pub id: u64,
    /// The backend's completion URL (http or https).
    pub url: &'a str,
    pub tls: Option<&'a upstream::Tls>,
    pub body: Vec<u8>,
    /// Sent upstream as `X-Request-Id`.
    pub request_id: &'a str,
    pub sink: Sink,
}

/// The live streams and what opening one needs: cheap to clone, so the native front opens
/// and controls streams from its own tasks.
#[derive(Clone)]
pub struct Streams {
    handle: tokio::runtime::Handle,
    shared: Arc<Shared>,
    live: Arc<Mutex<FxHashMap<u64, UnboundedSender<Control>>>>,
    closed: Arc<std::sync::atomic::AtomicBool>,
}

/// The relay: its threads, its upstream connection pool, and the live streams.
pub struct Relay {
    runtime: Option<tokio::runtime::Runtime>,
    streams: Streams,
}

impl Relay {
    /// Start the relay's threads.
    pub fn new(config: RelayConfig) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.threads.max(1))
            .thread_name("llmflow-relay")
            .enable_all()
            .build()?;
        let shared = Arc::new(Shared {
            pool: upstream::Pool::default(),
            config,
            stats: Stats::default(),
        });
        let streams = Streams {
            handle: runtime.handle().clone(),
            shared,
            live: Arc::default(),
            closed: Arc::default(),
        };
        Ok(Self {
            runtime: Some(runtime),
            streams,
        })
    }

    /// The live streams, to open and control them from elsewhere (the native front).
    pub fn streams(&self) -> &Streams {
        &self.streams
    }

    /// The relay's tokio runtime, which the front door shares (one runtime per process, sized
    /// by `server.workers`); None once shut down.
    pub fn handle(&self) -> Option<tokio::runtime::Handle> {
        self.runtime.as_ref().map(|r| r.handle().clone())
    }

    /// See [`Streams::open`].
    ///
    /// # Errors
    /// The URL or a header is malformed, or `id` is already live.
    pub fn open(&self, request: StreamRequest<'_>) -> Result<(), String> {
        self.streams.open(request)
    }

    /// See [`Streams::control`].
    pub fn control(&self, id: u64, control: Control) -> bool {
        self.streams.control(id, control)
    }

    /// Streams still running.
    pub fn live(&self) -> usize {
        self.streams.live.lock().unwrap().len()
    }

    pub fn stats(&self) -> &Stats {
        &self.streams.shared.stats
    }

    /// Stop every stream and the relay's threads, without waiting for them, and close the
    /// idle upstream connections.
    pub fn shutdown(&mut self) {
        self.streams.closed.store(true, Ordering::SeqCst);
        self.streams.live.lock().unwrap().clear();
        self.streams.shared.pool.close_idle();
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl Streams {
    /// Send a streamed completion upstream and relay it.
    ///
    /// # Errors
    /// The URL or a header is malformed, `id` is already live, or the relay has shut down.
    pub fn open(&self, request: StreamRequest<'_>) -> Result<(), String> {
        self.launch(request, false)
    }

    /// Send a request whose answer is read whole, with no client (see [`HopRequest`]).
    ///
    /// # Errors
    /// As [`Streams::open`].
    pub fn hop(&self, request: HopRequest<'_>) -> Result<(), String> {
        let HopRequest {
            id,
            url,
            tls,
            body,
            request_id,
            sink,
        } = request;
        let request = StreamRequest {
            id,
            url,
            tls,
            body,
            request_id,
            traceparent: None,
            include_usage: false,
            continuous_usage: false,
            choices: 1,
            unstreamed: true,
            whole: true,
            kind: ReplyKind::Chunks,
            sink,
        };
        self.launch(request, true)
    }

    fn launch(&self, request: StreamRequest<'_>, hop: bool) -> Result<(), String> {
        let StreamRequest {
            id,
            url,
            tls,
            body,
            request_id,
            traceparent,
            include_usage,
            continuous_usage,
            choices,
            unstreamed,
            whole,
            kind,
            sink,
        } = request;
        let uri: hyper::Uri = url
            .parse()
            .map_err(|e| format!("bad backend URL {url:?}: {e}"))?;
        let (Some(authority), Some(path)) = (uri.authority(), uri.path_and_query()) else {
            return Err(format!(
                "bad backend URL {url:?}: it needs a host and a path"
            ));
        };
        let (tls, default_port) = match uri.scheme_str() {
            Some("http") => (None, 80),
            Some("https") => (
                Some(tls.cloned().unwrap_or_else(upstream::Tls::mozilla)),
                443,
            ),
            _ => {
                return Err(format!(
                    "bad backend URL {url:?}: the relay speaks http and https"
                ))
            }
        };
        let port = authority.port_u16().unwrap_or(default_port);
        let origin = upstream::Origin::new(authority.host(), port, tls)
            .map_err(|e| format!("bad backend URL {url:?}: {e}"))?;
        hyper::header::HeaderValue::from_str(request_id)
            .map_err(|e| format!("bad request id {request_id:?}: {e}"))?;
        if let Some(traceparent) = traceparent {
            hyper::header::HeaderValue::from_str(traceparent)
                .map_err(|e| format!("bad traceparent {traceparent:?}: {e}"))?;
        }
        if self.closed.load(Ordering::SeqCst) {
            return Err("the relay has shut down".to_owned());
        }
        let (tx, rx) = unbounded_channel();
        {
            let mut live = self.live.lock().unwrap();
            if live.contains_key(&id) {
                return Err(format!("request {id} is already relayed"));
            }
            live.insert(id, tx);
        }
        let shared = Arc::clone(&self.shared);
        let live = Arc::clone(&self.live);
        let open = stream::Open {
            id,
            origin,
            path: path.as_str().to_owned(),
            body: Bytes::from(body),
            request_id: request_id.to_owned(),
            traceparent: traceparent.map(str::to_owned),
            include_usage,
            continuous_usage,
            choices,
            unstreamed,
            whole: whole || unstreamed,
            hop,
            kind,
            sink,
        };
        self.handle.spawn(async move {
            let sink = open.sink.clone();
            let closed = stream::run(shared, open, rx).await;
            live.lock().unwrap().remove(&id);
            let _ = sink.send(closed);
        });
        Ok(())
    }

    /// Hand a live stream a control; false when the stream has already ended.
    pub fn control(&self, id: u64, control: Control) -> bool {
        let live = self.live.lock().unwrap();
        live.get(&id).is_some_and(|tx| tx.send(control).is_ok())
    }

    /// `control`, and a receiver that hears when the stream has carried it out (or ended: the
    /// sender is dropped); None when the stream had already ended. An abort has closed the
    /// upstream socket when it hears, so vLLM learns of it before the request sent next.
    pub fn control_acked(
        &self,
        id: u64,
        control: Control,
    ) -> Option<std::sync::mpsc::Receiver<()>> {
        let (done, carried_out) = std::sync::mpsc::sync_channel(1);
        let live = self.live.lock().unwrap();
        let tx = live.get(&id)?;
        if tx.send(control).is_err() {
            return None;
        }
        let _ = tx.send(Control::Ack(done));
        Some(carried_out)
    }

    /// Whether `id` is a live stream.
    pub fn is_live(&self, id: u64) -> bool {
        self.live.lock().unwrap().contains_key(&id)
    }

    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    pub fn handle(&self) -> &tokio::runtime::Handle {
        &self.handle
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests;
