//! A governed completion served natively: the client's request in, the runtime's decisions
//! carried out, the reply through the relay, the connection back for its next request.
//!
//! This serves every HTTP request to these routes (the Python path that did before is deleted;
//! its answers are the tests' goldens): a completion the checks accept, of any number of
//! choices, streamed, whole, or asked unstreamed (see `prepare.rs`), and a response
//! (`responses.rs`): the same life, with the relay reading vLLM's events (`ReplyKind::Events`),
//! the whole reply kept as the Responses API's final object, and a cut ending in an `error`
//! event. What the checks refuse it answers with the app's error (`accept`), before the runtime
//! hears of it; the app's middleware's answers came before the body was read (`screen`,
//! `middleware.rs`); a runtime that does not take the arrival, or a body the checks cannot
//! judge (neither happens short of a bug), is the app's 500. The task decides
//! nothing: it feeds the runtime what happened (arrive, started, tokens, done, failed,
//! the client's window and departure) and carries out what the runtime answers (queue, start,
//! abort, reply, cut, end), as the owner routes it here. A `Start` naming a prefill instance
//! (a split pool) goes upstream twice, as `session._prefill_hop` sends it: the prefill hop
//! (`disagg.rs`, a relay `hop`), `prefilled` fed when it answered, then the decode hop.

use std::os::fd::FromRawFd;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::owner::{now_us, Order, Owner};
use super::prepare::Endpoint;
use super::record::Record;
use super::{Conn, Outcome, Request};
use crate::relay::{
    Control, Ending, Failure, HopRequest, RelayEvent, ReplyKind, StreamRequest, Streams,
};
use crate::runtime::{Action, Event, PrefillHop};
use crate::types::Outcome as End;

const SSE_HEAD: &[u8] = b"HTTP/1.1 200 OK\r\n\
    content-type: text/event-stream; charset=utf-8\r\n\
    cache-control: no-cache\r\n\
    x-accel-buffering: no\r\n\
    transfer-encoding: chunked\r\n";

/// Where and how a backend gets its requests (indexed by the runtime's backend id).
#[derive(Debug, Clone)]
pub struct BackendRoute {
    pub name: String,
    /// `http://host:port` or `https://host:port`.
    pub url: String,
    /// An https backend's TLS (`tls_ca_file`, `tls_client_cert`); None: the Mozilla roots
    /// and no client certificate.
    pub tls: Option<crate::relay::upstream::Tls>,
    /// vLLM runs with `--scheduling-policy priority`: the body carries the core's priority.
    pub priority_scheduling: bool,
}

/// What a native request needs from the gateway: the owner, the relay, the checks.
pub struct Governed {
    pub owner: Arc<Owner>,
    pub streams: Streams,
    pub checks: super::prepare::FrontConfig,
    pub keys: super::auth::KeyRing,
    pub backends: Vec<BackendRoute>,
    /// A keyless gateway's own names (`server.allowed_hosts` and the like): a request whose
    /// Host is another name, or whose Origin is not its Host, is refused (`origin.rs`).
    pub own_hosts: Option<Vec<String>>,
    /// How long a client may take none of a reply this task writes (`server.write_timeout_ms`,
    /// as the Python listener's write timer).
    pub write_timeout: Duration,
    /// `telemetry`, when on: each request's trace ids, its `traceparent` upstream.
    pub tracing: Option<super::traceparent::Tracing>,
}

impl super::Native for Governed {
    fn serve(
        self: Arc<Self>,
        request: Request,
        conn: Conn,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Outcome> + Send>> {
        Box::pin(async move { self.serve_request(request, conn).await })
    }

    fn screen(&self, request: &Request, max_body_bytes: usize) -> super::Screen {
        let own = self.own_hosts.as_deref();
        if let Some(answer) =
            super::middleware::middleware_answer(request, own, Some(max_body_bytes))
        {
            return super::Screen::Close(answer);
        }
        match self.keys.check(header(request, "authorization")) {
            Ok(_) => super::Screen::Read,
            Err(message) => super::Screen::Refuse(super::reply::ErrorReply::unauthorized(message)),
        }
    }
}

/// A request the checks accepted: who sent it, what it asks, how the runtime names them.
struct Accepted {
    identity: super::auth::Identity,
    prepared: super::prepare::Prepared,
    signals: super::signals::ClientSignals,
    tenant: u32,
    pool: u32,
    /// The runtime protects the tenant's tier: its connection skips the intake's turns.
    protected: bool,
}

/// What the checks make of a request: serve it, answer it with the error Python's path
/// answers (before the runtime hears of it, as there), or pass it to the app.
enum Checked {
    Accept(Accepted),
    /// The route's error: the connection goes on as the client asked.
    Refuse(super::reply::ErrorReply),
    /// An answer after which the connection closes (the middleware's, written whole).
    Close(Vec<u8>),
    Decline,
}

/// A request the front took: what it asked, and what has happened to it so far.
#[allow(clippy::struct_excessive_bools)] // one request's state flags, each read in one place
struct Life {
    id: u64,
    prepared: super::prepare::Prepared,
    /// The client's socket while it is ours (the relay holds it once attached).
    stream: Option<tokio::net::TcpStream>,
    peer: std::net::SocketAddr,
    /// Bytes of the client's next request, read with this one (pipelining).
    buffered: bytes::BytesMut,
    keep_alive: bool,
    record: Record,
    /// The relay has the request (its events come on `events`).
    opened: bool,
    /// The relay has the client's socket.
    attached: bool,
    /// A terminal action (`Reply`, `Cut`, `End`) has come.
    ended: bool,
    /// The relay was told to end the reply with a frame of its own (`Cut`): it writes it to
    /// the end and hands the socket back, and the `End` after it closes nothing.
    cut_in_band: bool,
    /// Watch the client's socket for its departure (until it pipelines a next request).
    watching: bool,
    template: Option<String>,
    /// The reply being assembled, for a client that did not ask for a stream (the relay gives
    /// this task its payloads; the client's socket stays here).
    whole: Option<super::whole::Assembled>,
    /// vLLM's answer to a request sent unstreamed (`RelayEvent::Answer`): the reply, unless
    /// a cut came first.
    unstreamed_answer: Option<Vec<u8>>,
    failure: Option<Failure>,
    /// An error to answer with once the relay gives the connection back (`GiveBack`).
    answer: Option<Vec<u8>>,
    /// A split request's prefill hop, live in the relay under this request's id (its events
    /// come on `events` too) until it closes; then the decode hop is opened.
    prefill: Option<Prefill>,
    /// The task is over: the connection (if any) goes back to the front.
    finished: bool,
    /// Orders of `arrive`'s own answer not yet carried out (a `Reply` among them: refused).
    arrival_orders: usize,
    /// The runtime protects the request's tier (the connection's next request skips the
    /// intake's turns).
    express: bool,
}

/// An idle stream keeps no read buffer (the front's 8 KiB): a pipelined request's bytes, if
/// any, are kept as they are.
fn kept_for_an_idle_stream(buffered: bytes::BytesMut) -> bytes::BytesMut {
    if buffered.is_empty() {
        bytes::BytesMut::new()
    } else {
        buffered
    }
}

/// A split request's prefill hop in flight (`disagg.rs`), and the decode hop that follows it.
struct Prefill {
    /// The decode hop's `Start`: its backend, priority and brownout bound.
    backend: u32,
    priority: i64,
    max_tokens: Option<u64>,
    /// The prefill instance (the warning of an answer without parameters names it).
    url: String,
    /// Its answer, once read whole.
    answer: Option<Vec<u8>>,
}

impl Governed {
    /// What the native path needs of a request it is sure of, or the error Python answers it
    /// with, in the order Python's checks run (the middleware, the key, the body).
    fn accept(&self, request: &Request) -> Checked {
        let endpoint = match request.path() {
            "/v1/chat/completions" => Endpoint::Chat,
            "/v1/completions" => Endpoint::Completions,
            "/v1/responses" => Endpoint::Responses,
            _ => return Checked::Decline,
        };
        // The middleware's answers came first (`screen`, before the body was read).
        let identity = match self.keys.check(header(request, "authorization")) {
            Ok(identity) => identity.clone(),
            Err(message) => {
                return Checked::Refuse(super::reply::ErrorReply::unauthorized(message))
            }
        };
        match super::prepare::checked(endpoint, &request.body, &self.checks) {
            Ok(prepared) => self.accept_body(identity, prepared, request),
            Err(super::prepare::NotServed::Refused(error)) => Checked::Refuse(*error),
            Err(super::prepare::NotServed::Unsure) => {
                // The checks' two readings of the body disagree: no body the property tests
                // draw does this, and the app has no route to pass it to.
                let why = "the checks could not judge a body (prepare::NotServed::Unsure)";
                Checked::Close(internal_error(request.keep_alive, why))
            }
        }
    }

    /// The rest of `accept`, once the key and the body are known good: the client's signals
    /// (ours malformed: the route's 400), the runtime's names for its tenant and pool (which
    /// the checks make sure of; failing, Python's `arrive` raises: the app's 500).
    fn accept_body(
        &self,
        identity: super::auth::Identity,
        prepared: super::prepare::Prepared,
        request: &Request,
    ) -> Checked {
        // Streamed, or assembled whole from the stream (`whole.rs`), any number of choices;
        // or asked unstreamed (prompt logprobs: vLLM's answer goes on as it wrote it).
        let headers = request
            .headers
            .iter()
            .map(|(n, v)| (n.as_bytes(), v.as_slice()));
        let signals = match super::signals::read_signals(headers) {
            Ok(signals) => signals,
            Err(invalid) => return Checked::Refuse(invalid.reply()),
        };
        let names = self.owner.read(|runtime| {
            let gov = runtime.governor();
            let tenant = gov.tenant_id(&identity.tenant).ok()?;
            let pool = gov.pool_of(Some(&prepared.model)).ok()?;
            Some((tenant, pool, gov.is_protected(tenant)))
        });
        let Some((tenant, pool, protected)) = names else {
            let why = format!(
                "the runtime knows no tenant {:?} or no pool of model {:?}",
                identity.tenant, prepared.model
            );
            return Checked::Close(internal_error(request.keep_alive, &why));
        };
        Checked::Accept(Accepted {
            identity,
            prepared,
            signals,
            tenant,
            pool,
            protected,
        })
    }

    async fn serve_request(self: Arc<Self>, request: Request, conn: Conn) -> Outcome {
        let Accepted {
            identity,
            prepared,
            signals,
            tenant,
            pool,
            protected,
        } = match self.accept(&request) {
            Checked::Accept(accepted) => accepted,
            Checked::Refuse(error) => return refuse(&error, request.keep_alive, conn).await,
            Checked::Close(answer) => return answer_and_close(&answer, conn).await,
            Checked::Decline => return Outcome::Declined(request, conn),
        };
        let id = self.owner.new_id();
        let (tx, orders) = unbounded_channel();
        let arrived_us = now_us();
        let live = super::owner::Live {
            tenant: identity.tenant.clone(),
            tier: identity.tier.clone(),
            arrived_us,
            ..super::owner::Live::default()
        };
        self.owner.register(id, tx, live);
        let event = Event::Arrive {
            id,
            tenant,
            prompt: prepared.prompt_tokens,
            max_tokens: prepared.planned_tokens,
            stream: prepared.stream,
            pool,
            chain: prepared.prefix_hashes.clone().unwrap_or_default(),
            fingerprint: prepared.fingerprint,
            retries: signals.retries,
            deadline_ms: signals.deadline_ms,
        };
        if let Err(error) = self.owner.feed(&event) {
            // The runtime never took it (short of a bug, it takes every arrival): Python's
            // `arrive` raised there, and the app answered its 500.
            self.owner.unregister(id);
            let why = format!("the runtime refused an arrival: {error}");
            return answer_and_close(&internal_error(request.keep_alive, &why), conn).await;
        }
        // Taken: of the request's head and body, only whether the connection goes on and the
        // trace it continues are kept.
        let keep_alive = request.keep_alive;
        let trace = self
            .tracing
            .as_ref()
            .map(|tracing| tracing.begin(header(&request, "traceparent")));
        drop(request);
        let record = Record {
            id,
            tenant: identity.tenant.clone(),
            tier: identity.tier.clone(),
            arrived_us,
            prompt_tokens: prepared.prompt_tokens,
            max_tokens: Some(prepared.planned_tokens),
            path: prepared.endpoint.path(),
            stream: prepared.stream,
            model: prepared.model.clone(),
            trace,
            ..Record::default()
        };
        let whole = (!prepared.stream).then(|| {
            super::whole::Assembled::new(prepared.endpoint, &prepared.asked_model, prepared.choices)
        });
        let state = Life {
            id,
            prepared,
            stream: Some(conn.stream),
            peer: conn.peer,
            buffered: kept_for_an_idle_stream(conn.buffered),
            keep_alive,
            record,
            opened: false,
            attached: false,
            ended: false,
            cut_in_band: false,
            watching: true,
            template: None,
            whole,
            unstreamed_answer: None,
            failure: None,
            answer: None,
            prefill: None,
            finished: false,
            arrival_orders: 0,
            express: protected,
        };
        let mut guard = Abandon {
            owner: &self.owner,
            streams: &self.streams,
            id,
            armed: true,
        };
        let conn = self.run(state, orders).await;
        guard.armed = false;
        self.owner.unregister(id);
        Outcome::Served(conn)
    }

    async fn run(&self, mut life: Life, mut orders: UnboundedReceiver<Order>) -> Option<Conn> {
        let (sink, mut events) = unbounded_channel();
        let mut peek = [0u8; 1];
        // What `arrive` answered is in the channel already, and nothing else yet.
        life.arrival_orders = orders.len();
        while !life.finished {
            let watching = life.watching && !life.attached && life.stream.is_some();
            tokio::select! {
                biased;
                order = orders.recv() => match order {
                    Some(order) => {
                        self.carry(&mut life, order, &sink).await;
                        life.arrival_orders = life.arrival_orders.saturating_sub(1);
                    }
                    None => life.finished = true,
                },
                event = events.recv(), if life.opened || life.prefill.is_some() => match event {
                    Some(event) if life.prefill.is_some() => self.hop_event(&mut life, event, &sink),
                    Some(event) => self.relayed(&mut life, event).await,
                    None => life.finished = true,
                },
                seen = async { life.stream.as_ref().unwrap().peek(&mut peek).await }, if watching => {
                    match seen {
                        Ok(0) | Err(_) => {
                            life.watching = false;
                            let id = life.id;
                            self.feed(&Event::ClientGone { id });
                        }
                        // A pipelined next request: not ours, and the client is still there.
                        Ok(_) => life.watching = false,
                    }
                }
            }
        }
        life.record.ended_us = now_us();
        self.owner.record(std::mem::take(&mut life.record));
        let stream = life.stream.take()?;
        Some(Conn {
            stream,
            peer: life.peer,
            buffered: life.buffered,
            express: life.express,
        })
    }

    /// Feed an event about this request.
    fn feed(&self, event: &Event) {
        // An event the runtime refuses names a request it already ended: nothing to do.
        let _ = self.owner.feed(event);
    }

    /// Carry out one of the runtime's actions for this request.
    async fn carry(&self, life: &mut Life, order: Order, sink: &crate::relay::Sink) {
        match order.action {
            Action::Start {
                backend,
                priority,
                queue_wait_us,
                max_tokens,
                prefill,
                ..
            } => {
                if !order.after.is_empty() {
                    let after = order.after;
                    let wait = move || crate::hosted::wait_all(&after, crate::hosted::ABORT_WAIT);
                    let _ = tokio::task::spawn_blocking(wait).await;
                }
                life.record.queue_wait_us = Some(queue_wait_us);
                life.record.brownout_max_tokens = max_tokens;
                self.start(life, backend, priority, max_tokens, prefill, sink);
            }
            Action::Abort { .. } => {
                // The owner handed the abort to the relay already (before any `Start`).
                self.streams.control(life.id, Control::Abort);
            }
            Action::Reply {
                status,
                reason,
                retry_after_s,
                ..
            } => {
                self.close_prefill(life);
                self.reply(life, status, reason, retry_after_s).await;
            }
            Action::Cut { reason, .. } => {
                self.close_prefill(life);
                self.cut(life, reason).await;
            }
            Action::End { outcome, .. } => {
                self.close_prefill(life);
                life.ended = true;
                outcome_name(outcome).clone_into(&mut life.record.end);
                if !life.opened {
                    life.stream = None; // the client left (or never got a reply): close
                    life.finished = true;
                } else if outcome != End::Completed && !life.cut_in_band {
                    self.streams.control(life.id, Control::Close);
                    if life.whole.is_some() {
                        life.stream = None; // the client left: nothing to write
                    }
                } else if let Some(whole) = &life.whole {
                    // Written once the relay's stream is over (`Closed`: its token count).
                    life.answer = Some(self.whole_bytes(life, whole, None));
                }
            }
            // Queued: the client waits. The rest are no request's own: routed elsewhere.
            Action::Queued { .. }
            | Action::Arm { .. }
            | Action::Backend { .. }
            | Action::Lease { .. }
            | Action::Release { .. } => {}
        }
    }

    /// The runtime's `Reply`: an error status before any of the reply was written.
    async fn reply(
        &self,
        life: &mut Life,
        status: u16,
        reason: crate::runtime::Reason,
        retry_after_s: Option<u32>,
    ) {
        life.ended = true;
        reason.as_str().clone_into(&mut life.record.end);
        // Refused at its arrival (a rejection), not ended later while it waited (as the
        // Python path counts a `Reply` raised from `arrive` only).
        life.record.refused = life.arrival_orders > 0;
        let retry_after = retry_after_s.map(u64::from);
        let error = match (&life.failure, reason.as_str()) {
            (Some(f), "upstream_error") => super::reply::upstream_reply_error(
                status,
                retry_after,
                life.id,
                (f.status, f.code, &f.message),
                f.error.as_deref(),
            ),
            _ => super::reply::reply_error(reason.as_str(), status, retry_after, life.id),
        };
        let date = super::answer::http_date(std::time::SystemTime::now());
        let defaults: [(&[u8], &[u8]); 2] = [(b"date", date.as_bytes()), (b"server", b"uvicorn")];
        let bytes = error.response_bytes(&defaults, life.keep_alive);
        life.record.error = Some((status, error.code));
        life.record.retry_after_s = retry_after_s;
        if life.attached {
            // The relay holds the connection, unwritten: it gives it back (`Closed`), and the
            // answer is written then.
            life.record.upstream_aborted = life.record.started_us.is_some();
            life.answer = Some(bytes);
            if !self.streams.control(life.id, Control::GiveBack) {
                life.finished = true; // the stream had ended, and the socket with it
            }
            return;
        }
        if life.opened {
            self.streams.control(life.id, Control::Close);
            life.record.upstream_aborted = life.record.started_us.is_some();
            if life.whole.is_some() {
                // Written when the stream is over (`Closed`: the tokens it counted).
                life.answer = Some(bytes);
                return;
            }
        }
        self.write_and_finish(life, &bytes).await;
    }

    /// The runtime's `Cut`: end the reply now, with the notice (or the in-band error).
    async fn cut(&self, life: &mut Life, reason: crate::runtime::Reason) {
        life.ended = true;
        reason.as_str().clone_into(&mut life.record.end);
        if let Some(mut whole) = life.whole.take() {
            // Not streamed: what came so far, the open choice ended with the notice.
            life.record.truncated = whole.cut(reason.as_str(), life.id, unix_now_s());
            let bytes = self.whole_bytes(life, &whole, Some(reason.as_str()));
            if life.opened {
                self.streams.control(life.id, Control::Close);
                life.answer = Some(bytes); // written when the stream is over (`Closed`)
            } else {
                self.write_and_finish(life, &bytes).await;
            }
            return;
        }
        let events = life.prepared.endpoint == Endpoint::Responses;
        let ending = match reason.as_str() {
            "client_stall" => None,
            "upstream_error" => life.failure.as_ref().map(|f| {
                let frame = if events {
                    super::responses::upstream_error_frame(f.error.as_deref(), &f.message, f.code)
                } else {
                    super::reply::in_band_error_frame(f.error.as_deref(), &f.message, f.code)
                };
                Ending::Frame(frame)
            }),
            // A Responses reply ends with an `error` event naming the reason (it was cut
            // whatever its output held: truncated).
            other if events => {
                life.record.truncated = true;
                Some(Ending::Frame(super::responses::cut_frame(other)))
            }
            other => Some(super::reply::cut_notice(
                life.prepared.endpoint,
                life.prepared.asked_model.clone(),
                other.to_owned(),
                life.id,
                unix_now_s(),
            )),
        };
        if life.opened {
            // A reply ended in-band is written to its end by the relay, which then hands the
            // connection back; one cut without a frame (a stalled client) is closed. The relay
            // knows which choices are still open: the notice names them (none: no notice).
            life.cut_in_band = ending.is_some();
            life.record.truncated |= matches!(ending, Some(Ending::Notice(_)));
            self.streams.control(life.id, Control::Cut(ending));
        } else {
            // Cut before it ever started: the reply is the notice alone, for every choice.
            let mut bytes = head(life);
            let open: Vec<u64> = (0..life.prepared.choices).collect();
            let frame = match ending {
                Some(Ending::Frame(frame)) => Some(frame),
                Some(Ending::Notice(notice)) => {
                    life.record.truncated = true;
                    Some(notice(&open, life.template.as_deref()))
                }
                None => None,
            };
            if let Some(frame) = frame {
                bytes.extend_from_slice(&chunked(&frame));
            }
            if !events {
                bytes.extend_from_slice(&chunked(b"data: [DONE]\n\n"));
            }
            bytes.extend_from_slice(b"0\r\n\r\n");
            self.write_and_finish(life, &bytes).await;
        }
    }

    fn start(
        &self,
        life: &mut Life,
        backend: u32,
        priority: i64,
        max_tokens: Option<u64>,
        prefill: Option<PrefillHop>,
        sink: &crate::relay::Sink,
    ) {
        let route = &self.backends[backend as usize];
        life.record.backend = Some(route.name.clone());
        self.owner
            .update(life.id, |l| l.backend = Some(route.name.clone()));
        life.record.started_us = Some(now_us());
        if let Some(hop) = prefill {
            self.prefill(life, hop, (backend, priority, max_tokens), sink);
            return;
        }
        let body = life
            .prepared
            .upstream_bytes(route.priority_scheduling.then_some(priority), max_tokens);
        self.open(life, backend, body, sink);
    }

    /// Send the request upstream to `backend` with `body`, relayed as the client asked.
    fn open(&self, life: &mut Life, backend: u32, body: Vec<u8>, sink: &crate::relay::Sink) {
        let route = &self.backends[backend as usize];
        let url = format!("{}{}", route.url, life.prepared.endpoint.path());
        let request_id = format!("llmflow-{}", life.id);
        let traceparent = life.record.trace.map(|trace| trace.traceparent());
        let opened = self.streams.open(StreamRequest {
            id: life.id,
            url: &url,
            tls: route.tls.as_ref(),
            body,
            request_id: &request_id,
            traceparent: traceparent.as_deref(),
            include_usage: life.prepared.include_usage,
            continuous_usage: life.prepared.continuous_usage,
            choices: life.prepared.choices,
            unstreamed: life.prepared.unstreamed,
            whole: life.whole.is_some(),
            kind: match life.prepared.endpoint {
                Endpoint::Responses => ReplyKind::Events,
                Endpoint::Chat | Endpoint::Completions => ReplyKind::Chunks,
            },
            sink: sink.clone(),
        });
        match opened {
            Ok(()) => {
                life.opened = true;
                // Sent: the body's tree is not needed again (a cut names the asked model).
                life.prepared.body = super::json::Json::Null;
                if life.whole.is_none() {
                    self.hold(life);
                }
            }
            Err(message) => self.unopened(life, message),
        }
    }

    /// A URL the relay cannot speak to: the backend failed this request.
    fn unopened(&self, life: &mut Life, message: String) {
        life.failure = Some(Failure::backend("backend_unavailable", message, true));
        self.feed(&Event::Failed {
            id: life.id,
            status: 502,
            backend_down: true,
        });
    }

    /// P/D: send the prefill hop (`session._prefill_hop`: the request's body, with the hop's
    /// own priority where its instance schedules by priority, shaped by `disagg.rs`), not
    /// streamed, with the decode hop's `X-Request-Id`; the decode hop (`decode`: its backend,
    /// priority and bound) goes when it answers (`hop_event`).
    fn prefill(
        &self,
        life: &mut Life,
        hop: PrefillHop,
        decode: (u32, i64, Option<u64>),
        sink: &crate::relay::Sink,
    ) {
        let route = &self.backends[hop.backend as usize];
        let mut body = life.prepared.body.clone();
        if route.priority_scheduling {
            let priority = super::json::Json::Int(i128::from(hop.priority));
            super::prepare::set(&mut body, "priority", priority);
        }
        let body = super::prepare::dumps(&super::disagg::prefill_body(&body));
        let url = format!("{}{}", route.url, life.prepared.endpoint.path());
        let request_id = format!("llmflow-{}", life.id);
        let sent = self.streams.hop(HopRequest {
            id: life.id,
            url: &url,
            tls: route.tls.as_ref(),
            body,
            request_id: &request_id,
            sink: sink.clone(),
        });
        match sent {
            Ok(()) => {
                let (backend, priority, max_tokens) = decode;
                life.prefill = Some(Prefill {
                    backend,
                    priority,
                    max_tokens,
                    url: route.url.clone(),
                    answer: None,
                });
            }
            Err(message) => self.unopened(life, message),
        }
    }

    /// One of the relay's events for a prefill hop: its answer, its failure (fed as the
    /// decode's would be), its end. Once it closed with an answer the runtime hears
    /// `prefilled` (the prefill instance's slot is free), and the decode hop goes with the
    /// answer's `kv_transfer_params` (none: it computes the prompt; Python logs the warning
    /// `prefill_hop` logs, from the request's record).
    /// A hop or the reply's stream failed upstream: kept for the answer, fed to the runtime
    /// (which decides the status and the backend's health) unless the request already ended.
    fn failed(&self, life: &mut Life, failure: crate::relay::events::Failure) {
        let (id, status, backend_down) = (life.id, failure.status, failure.backend_down);
        life.failure = Some(failure);
        if !life.ended {
            self.feed(&Event::Failed {
                id,
                status,
                backend_down,
            });
        }
    }

    fn hop_event(&self, life: &mut Life, event: RelayEvent, sink: &crate::relay::Sink) {
        let id = life.id;
        match event {
            RelayEvent::Answer(_, answer) => {
                if let Some(prefill) = life.prefill.as_mut() {
                    prefill.answer = Some(answer);
                }
            }
            RelayEvent::Failed(_, failure) => self.failed(life, failure),
            RelayEvent::Closed { .. } => {
                let Some(prefill) = life.prefill.take() else {
                    return;
                };
                if life.ended || life.failure.is_some() {
                    return; // the runtime's answer to the failure ends it
                }
                let Some(answer) = prefill.answer else {
                    // The relay ended it on its own (it cannot, short of a bug): end it here.
                    self.feed(&Event::ClientGone { id });
                    return;
                };
                let params = super::disagg::kv_transfer_params(&answer);
                if params.is_none() {
                    life.record.prefill_unread = Some(prefill.url);
                }
                self.feed(&Event::Prefilled { id });
                let route = &self.backends[prefill.backend as usize];
                let priority = route.priority_scheduling.then_some(prefill.priority);
                let body = life.prepared.upstream_body(priority, prefill.max_tokens);
                let body = super::prepare::dumps(&super::disagg::decode_body(body, params));
                self.open(life, prefill.backend, body, sink);
            }
            // A hop has no client and counts no token; its `Done` is its `Closed`.
            _ => {}
        }
    }

    /// A terminal action during the prefill hop: close it (vLLM aborts it), and the decode hop
    /// is never sent.
    fn close_prefill(&self, life: &mut Life) {
        if life.prefill.take().is_some() {
            self.streams.control(life.id, Control::Close);
        }
    }

    /// One of the relay's events for this request.
    async fn relayed(&self, life: &mut Life, event: RelayEvent) {
        let id = life.id;
        match event {
            RelayEvent::Started(_) => {
                if !life.ended {
                    self.feed(&Event::Started { id });
                }
            }
            RelayEvent::FirstToken { n, template, .. } => {
                life.template = template;
                life.record.first_token_us = Some(now_us());
                if life.whole.is_none() {
                    self.owner.update(id, |l| l.streaming = true); // it is not, for a whole one
                }
                self.owner.record(Record {
                    first_token_only: true,
                    ..life.record.clone()
                });
                if !life.ended {
                    self.feed(&Event::Tokens {
                        id,
                        n: u64::from(n),
                    });
                }
            }
            RelayEvent::Payload(_, payload) => self.fold(life, &payload),
            RelayEvent::Answer(_, answer) => {
                if !life.ended {
                    life.unstreamed_answer = Some(answer);
                }
            }
            // The stream tallied them (at most `token_flush` late, and before its next event).
            RelayEvent::Tokens(_, n) => self.feed(&Event::Tokens {
                id,
                n: u64::from(n),
            }),
            RelayEvent::Done(_) => {
                if !life.ended {
                    self.feed(&Event::Done { id });
                }
            }
            RelayEvent::Failed(_, failure) => self.failed(life, failure),
            RelayEvent::WindowFull(_) => {
                if !life.ended {
                    self.feed(&Event::WindowFull { id });
                }
            }
            RelayEvent::WindowDrained(_) => {
                if !life.ended {
                    self.feed(&Event::WindowDrained { id });
                }
            }
            RelayEvent::ClientGone(_) => {
                if !life.ended {
                    self.feed(&Event::ClientGone { id });
                }
            }
            RelayEvent::Closed {
                socket,
                upstream_complete,
                completion_tokens,
                truncated,
                ..
            } => {
                life.record.completion_tokens = completion_tokens;
                let events = life.prepared.endpoint == Endpoint::Responses;
                if life.cut_in_band && life.whole.is_none() && !events {
                    // The relay wrote the cut's ending: truncated only if a choice was open.
                    life.record.truncated = truncated;
                }
                if life.record.started_us.is_some() && !upstream_complete {
                    life.record.upstream_aborted = true;
                }
                if !life.ended {
                    // The relay ended it on its own (it cannot, short of a bug): end it here.
                    self.feed(&Event::ClientGone { id });
                }
                if life.attached {
                    life.stream = match socket {
                        Some(fd) if life.keep_alive || life.answer.is_some() => readopt(fd),
                        Some(fd) => {
                            // SAFETY: the relay handed this socket back to us; we close it.
                            drop(unsafe { std::net::TcpStream::from_raw_fd(fd) });
                            None
                        }
                        None => None,
                    };
                }
                match life.answer.take() {
                    Some(answer) => self.write_and_finish(life, &answer).await,
                    None => life.finished = true,
                }
            }
        }
    }

    /// One upstream payload into the reply assembled whole.
    fn fold(&self, life: &mut Life, payload: &[u8]) {
        let Some(whole) = life.whole.as_mut().filter(|_| !life.ended) else {
            return;
        };
        if let Err(unread) = whole.feed(payload) {
            // As the Python path fails a reply it cannot read: the backend's failure.
            self.streams.control(life.id, Control::Abort);
            life.failure = Some(Failure::backend("backend_error", unread.message(), false));
            let failed = Event::Failed {
                id: life.id,
                status: 502,
                backend_down: false,
            };
            self.feed(&failed);
        }
    }

    /// Lend the relay the client's socket now: it writes the head with the first piece of the
    /// reply (the first token, or a cut's notice), the rest, and the end, in the same task
    /// that reads vLLM, and gives the socket back after a clean end (or unwritten, asked).
    fn hold(&self, life: &mut Life) {
        let head = head(life);
        // The socket goes to the relay; the connection's other parts (its peer, the bytes of
        // a pipelined next request) stay here until the socket comes back.
        let Some(stream) = life.stream.take() else {
            return;
        };
        let Ok(socket) = stream.into_std() else {
            return;
        };
        life.attached = true;
        let hold = Control::Hold {
            socket,
            head,
            keep_alive: life.keep_alive,
        };
        // False: the stream had ended, and the relay closed the socket with it.
        self.streams.control(life.id, hold);
    }

    /// The bytes of a reply assembled whole (`cut`: the runtime's reason, when it cut it).
    fn whole_bytes(
        &self,
        life: &Life,
        whole: &super::whole::Assembled,
        cut: Option<&str>,
    ) -> Vec<u8> {
        let _ = self;
        // vLLM's answer once it came, even past a cut (as `StreamSession.response`).
        let body = life.unstreamed_answer.as_ref().map_or_else(
            || whole.body(unix_now_s(), &life.record.end),
            |answer| super::whole::answer_body(answer),
        );
        let date = super::answer::http_date(std::time::SystemTime::now());
        let defaults: [(&[u8], &[u8]); 2] = [(b"date", date.as_bytes()), (b"server", b"uvicorn")];
        super::reply::whole_response(&body, life.id, cut, &defaults, life.keep_alive)
    }

    async fn write_and_finish(&self, life: &mut Life, bytes: &[u8]) {
        life.finished = true;
        let Some(stream) = life.stream.as_mut() else {
            return;
        };
        if !write_in_time(stream, bytes, self.write_timeout).await || !life.keep_alive {
            life.stream = None;
        }
    }
}

/// Ends a request whose task is dropped before its end (the front closing its connections
/// at shutdown): the runtime hears the client left, the relay closes the stream, so no slot,
/// queue place or KV reservation outlives the task.
struct Abandon<'a> {
    owner: &'a Owner,
    streams: &'a Streams,
    id: u64,
    armed: bool,
}

impl Drop for Abandon<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.owner.feed(&Event::ClientGone { id: self.id });
            self.streams.control(self.id, Control::Close);
            self.owner.unregister(self.id);
        }
    }
}

/// `_on_unexpected`'s 500, as uvicorn writes it when the app raised after answering: the
/// connection closes after it. `why` goes to the process's stderr, beside Python's log (no
/// request the checks pass should come here: it is a bug to report).
fn internal_error(keep_alive: bool, why: &str) -> Vec<u8> {
    eprintln!("llmflow front: internal error, answered 500: {why}");
    let message = "the gateway failed on this request; it is logged, please report it";
    let error = super::reply::ErrorReply::checks(500, message.to_owned(), "internal_error", None);
    let date = super::answer::http_date(std::time::SystemTime::now());
    let defaults: [(&[u8], &[u8]); 2] = [(b"date", date.as_bytes()), (b"server", b"uvicorn")];
    error.response_bytes(&defaults, keep_alive)
}

/// Write an answer after which the connection ends, then close it as the front closes one
/// (lingering, so the client reads the answer rather than a reset).
async fn answer_and_close(answer: &[u8], mut conn: Conn) -> Outcome {
    if conn.stream.write_all(answer).await.is_ok() {
        super::http::linger(conn).await;
    }
    Outcome::Served(None)
}

/// Answer a request the checks refuse as uvicorn writes the app's `GatewayError`: the runtime
/// never hears of it, and the connection goes on as the app's would (kept alive unless the
/// client ends it).
async fn refuse(error: &super::reply::ErrorReply, keep_alive: bool, mut conn: Conn) -> Outcome {
    let bytes = super::answer::app_error(error, keep_alive, std::time::SystemTime::now());
    match conn.stream.write_all(&bytes).await {
        Ok(()) => Outcome::Served(Some(conn)),
        Err(_) => Outcome::Served(None),
    }
}

fn head(life: &Life) -> Vec<u8> {
    let mut head = SSE_HEAD.to_vec();
    head.extend_from_slice(format!("x-request-id: llmflow-{}\r\n", life.id).as_bytes());
    if !life.keep_alive {
        head.extend_from_slice(b"connection: close\r\n");
    }
    head.extend_from_slice(b"\r\n");
    head
}

fn chunked(frame: &[u8]) -> Vec<u8> {
    let mut out = format!("{:x}\r\n", frame.len()).into_bytes();
    out.extend_from_slice(frame);
    out.extend_from_slice(b"\r\n");
    out
}

fn header<'a>(request: &'a Request, name: &str) -> Option<&'a [u8]> {
    request
        .headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_slice())
}

/// Write `bytes`, a client that takes none of them for `timeout` failing the write (a whole
/// reply can be far larger than the socket's buffers).
async fn write_in_time(
    stream: &mut tokio::net::TcpStream,
    mut bytes: &[u8],
    timeout: Duration,
) -> bool {
    while !bytes.is_empty() {
        match tokio::time::timeout(timeout, stream.write(bytes)).await {
            Ok(Ok(n)) if n > 0 => bytes = &bytes[n..],
            _ => return false,
        }
    }
    true
}

/// The clock's whole seconds (a reply's `created` when no chunk named one).
fn unix_now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn outcome_name(outcome: End) -> &'static str {
    outcome.as_str()
}

/// A socket the relay handed back, as the front's again.
fn readopt(fd: i32) -> Option<tokio::net::TcpStream> {
    // SAFETY: the relay gave up this open socket and nothing else holds it.
    let socket = unsafe { std::net::TcpStream::from_raw_fd(fd) };
    socket.set_nonblocking(true).ok()?;
    tokio::net::TcpStream::from_std(socket).ok()
}
