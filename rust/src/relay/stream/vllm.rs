//! The upstream side of a stream: connecting to vLLM, its response, the SSE frames it reads,
//! and how a failure ends the stream.

use http_body_util::Full;

use crate::relay::events::Failure;
use crate::relay::upstream::{Driver, Origin, Pool};

use super::*;

impl Task {
    pub(super) fn on_connected(&mut self, conn: io::Result<Conn>) -> Step {
        let mut conn = match conn {
            Ok(conn) => conn,
            Err(e) => {
                self.push(RelayEvent::Failed(self.id, connect_failure(&e)));
                return Step::Go;
            }
        };
        let o = &self.open;
        let mut request = hyper::Request::post(o.path.as_str())
            .header("host", o.origin.authority.as_str())
            .header("content-type", "application/json")
            .header(
                "accept",
                if o.unstreamed {
                    "application/json"
                } else {
                    "text/event-stream"
                },
            )
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

    pub(super) async fn on_response(&mut self, res: hyper::Result<Response<Incoming>>) -> Step {
        let response = match res {
            Ok(r) => r,
            Err(e) => {
                let stale = self.conn.as_ref().is_some_and(|c| c.reused);
                self.conn = None;
                if stale && !self.retried {
                    // A kept-alive connection the backend had closed: once more, on a new one.
                    self.retried = true;
                    self.connecting = Some(connect_new(&self.shared, &self.open.origin));
                    return Step::Go;
                }
                self.push(RelayEvent::Failed(self.id, head_failure(&e)));
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
        if self.open.unstreamed {
            // Started when the answer is in, as the Python path feeds it (`_answer_from`).
            self.answer = Some(Vec::new());
            return Step::Go;
        }
        self.push(RelayEvent::Started(self.id));
        Step::Go
    }

    /// A piece of an unstreamed answer, or its end: read whole (up to `ANSWER_LIMIT`, as
    /// `read_all`; a body that breaks ends it too), then `Started`, its tokens, the answer and
    /// `Done`, or a failure when it is not a JSON object.
    fn on_answer(
        &mut self,
        frame: Option<Result<hyper::body::Frame<Bytes>, hyper::Error>>,
    ) -> Step {
        let answer = self.answer.as_mut().expect("reading an answer");
        match frame {
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    let room = ANSWER_LIMIT.saturating_sub(answer.len());
                    answer.extend_from_slice(&data[..data.len().min(room)]);
                    if answer.len() < ANSWER_LIMIT {
                        return Step::Go;
                    }
                }
                if answer.len() < ANSWER_LIMIT {
                    return Step::Go; // trailers
                }
                self.conn = None; // the rest is dropped with the connection
            }
            Some(Err(_)) => self.conn = None,
            None => {}
        }
        self.body = None;
        let raw = self.answer.take().unwrap_or_default();
        let value: serde_json::Value = match serde_json::from_slice(&raw) {
            Ok(value) => value,
            Err(e) => return self.fail(format!("backend sent bad JSON: {e}"), false),
        };
        if self.open.hop {
            // What the answer says is the host's to read (`prefill_hop` reads any JSON).
            let _ = self.open.sink.send(RelayEvent::Answer(self.id, raw));
            self.upstream_complete = true;
            self.clean = true;
            self.terminate();
            return Step::Go;
        }
        if !value.is_object() {
            let unread = "the gateway could not read the backend's reply".to_owned();
            return self.fail(unread, false);
        }
        let tokens = value
            .get("usage")
            .and_then(|u| u.get("completion_tokens"))
            .and_then(serde_json::Value::as_u64)
            .filter(|&n| n > 0);
        self.push(RelayEvent::Started(self.id));
        if let Some(tokens) = tokens {
            self.shaper.answered(tokens);
            let n = u32::try_from(tokens).unwrap_or(u32::MAX);
            let _ = self.open.sink.send(RelayEvent::Tokens(self.id, n));
        }
        let _ = self.open.sink.send(RelayEvent::Answer(self.id, raw));
        self.upstream_complete = true;
        self.clean = true;
        self.done_pending = true;
        self.upstream_ended();
        self.terminate();
        Step::Go
    }

    pub(super) fn on_frame(
        &mut self,
        frame: Option<Result<hyper::body::Frame<Bytes>, hyper::Error>>,
    ) -> Step {
        if self.answer.is_some() {
            return self.on_answer(frame);
        }
        if self.draining_body {
            match frame {
                Some(Ok(_)) => {}
                Some(Err(_)) => {
                    self.body = None;
                    self.conn = None;
                    self.upstream_ended();
                }
                None => {
                    self.body = None; // read to the end: the connection can serve again
                    self.upstream_ended();
                }
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
                let (why, down) = body_broke(&e);
                return self.fail(format!("backend stream broke: {why}"), down);
            }
            // A Responses stream sends no `[DONE]`: its body's clean end, nothing of an event
            // left unfinished, is the reply's end (`events(until_done=False)`).
            None if self.open.kind == ReplyKind::Events && !self.decoder.pending_text() => {
                self.body = None; // read to the end: the connection can serve again
                self.upstream_complete = true;
                self.clean = true;
                self.done_pending = true;
                self.terminate();
                self.upstream_ended();
                return self.write();
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
                            self.add_tokens(shaped.new_tokens);
                        } else {
                            self.first_sent = true;
                            self.release_head();
                            self.push(RelayEvent::FirstToken {
                                id: self.id,
                                n: shaped.new_tokens,
                                template: self.shaper.template(),
                            });
                        }
                    }
                    if self.open.whole {
                        // Not an event the runtime hears: the tokens tallied stay batched.
                        let _ = self.open.sink.send(RelayEvent::Payload(self.id, payload));
                    } else {
                        for frame in shaped.before.into_iter().chain(shaped.frame) {
                            self.add_frame(frame, now);
                        }
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
            let held = self.shaper.take_held();
            if !self.open.whole {
                for frame in held {
                    self.add_frame(frame, now);
                }
            }
            self.draining_body = true;
            self.drain_until = Some(now + BODY_END_WAIT);
            self.upstream_complete = true;
            self.clean = true;
            // The host hears `Done` when the body ends (`upstream_ended`), not at `[DONE]`:
            // vLLM's request is over then, so the slot the runtime frees on `Done` is free at
            // vLLM too when the next request takes it.
            self.done_pending = true;
            self.terminate();
        }
        self.write()
    }

    pub(super) fn fail(&mut self, message: String, backend_down: bool) -> Step {
        self.fail_with(Failure::backend("backend_error", message, backend_down))
    }

    pub(super) fn fail_with(&mut self, failure: Failure) -> Step {
        self.body = None;
        self.conn = None;
        self.push(RelayEvent::Failed(self.id, failure));
        Step::Go
    }

    /// The upstream reply is over (its body ended, or was given up after `[DONE]`): the
    /// host hears `Done` now.
    pub(super) fn upstream_ended(&mut self) {
        if std::mem::take(&mut self.done_pending) {
            self.push(RelayEvent::Done(self.id));
        }
    }

    pub(super) fn stop_upstream(&mut self) {
        if self.upstream_complete && self.draining_body {
            return; // the reply is whole: let the connection finish and serve again
        }
        self.connecting = None;
        self.response = None;
        self.body = None;
        self.conn = None; // closes the socket now, in this task
    }
}

/// Up to `limit` bytes of an error reply's body (the connection's driver runs meanwhile).
pub(super) async fn read_limited(mut body: Incoming, driver: &mut Driver, limit: usize) -> Vec<u8> {
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

pub(super) fn connect(shared: &Arc<Shared>, origin: &Origin) -> ConnectFuture {
    let shared = Arc::clone(shared);
    let origin = origin.clone();
    Box::pin(async move {
        let timeout = shared.config.connect_timeout;
        shared.pool.checkout(&origin, timeout).await
    })
}

/// A fresh connection (the retry after a stale kept-alive one).
pub(super) fn connect_new(shared: &Arc<Shared>, origin: &Origin) -> ConnectFuture {
    let timeout = shared.config.connect_timeout;
    let origin = origin.clone();
    Box::pin(async move { Pool::connect(&origin, timeout).await })
}

/// The message of an OpenAI- or FastAPI-style error body, else its text.
pub(super) fn error_message(raw: &[u8]) -> Option<String> {
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
pub(super) fn error_object(raw: &[u8]) -> Option<String> {
    crate::relay::chunk::raw_error(raw)
}

pub(super) fn value_text(v: &serde_json::Value) -> String {
    v.as_str().map_or_else(|| v.to_string(), str::to_owned)
}

pub(super) fn source_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// A failed connect, as the Python path's upstream words it: out of file descriptors is the
/// gateway's own shortage and says nothing of the backend (it stays up); anything else marks
/// the backend down, in the OS's words for the error (never the address), or a failed TLS
/// handshake by the kind of `ssl` exception Python raises for it.
fn connect_failure(e: &io::Error) -> Failure {
    if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) {
        return Failure::backend(
            "gateway_out_of_fds",
            "the gateway has no file descriptor left".to_owned(),
            false,
        );
    }
    let tls = e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>());
    let why = match (tls, e.raw_os_error()) {
        (Some(tls), _) => tls_failure(tls).to_owned(),
        (None, Some(errno)) => os_words(e, errno),
        (None, None) if e.kind() == io::ErrorKind::TimedOut => "TimeoutError".to_owned(),
        (None, None) => e.kind().to_string(),
    };
    Failure::backend(
        "backend_unavailable",
        format!("backend unreachable: {why}"),
        true,
    )
}

/// A request that got no response head, as the Python path words it (`http1.py`,
/// `upstream.py`): a TLS failure after the handshake (a backend that asks for a client
/// certificate refuses one that shows none with an alert) or a reset is the backend
/// unreachable, as for a failed connect; a connection closed before the head (over TLS, too,
/// without its `close_notify`) is the backend failing, and leaves it up.
fn head_failure(e: &hyper::Error) -> Failure {
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        if let Some(io) = cause.downcast_ref::<io::Error>() {
            let tls = io
                .get_ref()
                .is_some_and(<dyn std::error::Error + Send + Sync>::is::<rustls::Error>);
            if tls || io.raw_os_error().is_some() {
                return connect_failure(io);
            }
            if io.kind() == io::ErrorKind::UnexpectedEof {
                return head_cut();
            }
        }
        source = cause.source();
    }
    if e.is_incomplete_message() {
        return head_cut();
    }
    Failure::backend(
        "backend_error",
        format!("backend failed: {}", source_chain(e)),
        false,
    )
}

fn head_cut() -> Failure {
    Failure::backend(
        "backend_error",
        "backend failed: no response head: the backend closed the connection".to_owned(),
        false,
    )
}

/// The `ssl` exception Python's handshake raises for what rustls refused: a certificate that
/// does not verify (an unknown issuer, the wrong name, expired) is `SSLCertVerificationError`,
/// anything else (a backend that speaks no TLS, an alert) `SSLError`.
fn tls_failure(e: &rustls::Error) -> &'static str {
    match e {
        rustls::Error::InvalidCertificate(_) => "SSLCertVerificationError",
        _ => "SSLError",
    }
}

#[cfg(test)]
mod connect_failure_tests {
    use super::*;

    #[test]
    fn out_of_descriptors_is_the_gateways_own_and_leaves_the_backend_up() {
        for errno in [libc::EMFILE, libc::ENFILE] {
            let f = connect_failure(&io::Error::from_raw_os_error(errno));
            assert_eq!(
                (f.status, f.code, f.backend_down),
                (502, "gateway_out_of_fds", false)
            );
        }
    }

    #[test]
    fn a_refused_connect_marks_the_backend_down_in_the_os_words() {
        let f = connect_failure(&io::Error::from_raw_os_error(libc::ECONNREFUSED));
        assert_eq!((f.code, f.backend_down), ("backend_unavailable", true));
        assert_eq!(f.message, "backend unreachable: Connection refused");
        let timed_out = io::Error::new(io::ErrorKind::TimedOut, "connect timed out");
        assert_eq!(
            connect_failure(&timed_out).message,
            "backend unreachable: TimeoutError"
        );
    }

    #[test]
    fn a_refused_certificate_is_worded_as_pythons_ssl_exception_and_marks_the_backend_down() {
        // tokio-rustls hands a handshake's failure up as InvalidData around rustls's error
        let refused =
            |e: rustls::Error| connect_failure(&io::Error::new(io::ErrorKind::InvalidData, e));
        let unknown = refused(rustls::Error::InvalidCertificate(
            rustls::CertificateError::UnknownIssuer,
        ));
        assert_eq!(
            (unknown.status, unknown.code, unknown.backend_down),
            (502, "backend_unavailable", true)
        );
        assert_eq!(
            unknown.message,
            "backend unreachable: SSLCertVerificationError"
        );
        let wrong_name = refused(rustls::Error::InvalidCertificate(
            rustls::CertificateError::NotValidForName,
        ));
        assert_eq!(
            wrong_name.message,
            "backend unreachable: SSLCertVerificationError"
        );
        let not_tls = refused(rustls::Error::InvalidMessage(
            rustls::InvalidMessage::InvalidContentType,
        ));
        assert_eq!(not_tls.message, "backend unreachable: SSLError");
    }
}
