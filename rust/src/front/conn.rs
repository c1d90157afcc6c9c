//! One client connection's life: read a request, offer it to the native server or pass it to
//! the app, answer in order, keep the connection alive while both sides agree.
//!
//! Requests on one connection are served one after another, so pipelined requests are
//! answered in order: what a client sent ahead waits in `Conn::buffered` (read ahead while
//! the current reply is written) and is parsed when the reply is done.
//!
//! A request on a governed path is the front's whatever its framing or method (`take`): it
//! answers as the app does what the app answers before reading a body, reads the body as
//! uvicorn does (a declared length, chunks, after a `100 Continue` when asked), and hands it
//! to the native server; of these paths the app gets only a WebSocket handshake.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use std::os::fd::AsRawFd;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use std::time::SystemTime;

use super::answer::{answer, app_error};
use super::http::{self, Ending, Framing, Limits, Refusal, Unread, Unwanted};
use super::pass::{self, After, Body, Upstream};
use super::reply::ErrorReply;
use super::{Conn, Native, Outcome, Request, Screen};

/// Requests a connection may have queued behind the one being answered (`guard.py`'s
/// `MAX_PIPELINE`): a client that pipelines more is answered those, then closed.
const MAX_PIPELINE: usize = 16;

/// The governed generation routes, which the native server may serve.
const NATIVE_PATHS: [&str; 3] = ["/v1/chat/completions", "/v1/completions", "/v1/responses"];

/// What every connection of a front reads.
pub struct Setup {
    pub limits: Limits,
    /// Where uvicorn serves the app.
    pub app: std::path::PathBuf,
    /// The native server, once one is plugged in (read per request).
    pub native: RwLock<Option<Arc<dyn Native>>>,
    /// Requests passed to the app whose reply is not yet all written to its client: a
    /// shutdown waits for them before it drops the connections (`Front::passing`).
    pub passing: AtomicUsize,
    /// Turns at reading a request, for the connections not known to be a protected tier's.
    pub intake: Arc<super::intake::Intake>,
}

/// Counts a passed request in `Setup::passing` while it lives.
struct Passing<'a>(&'a AtomicUsize);

impl<'a> Passing<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Self(count)
    }
}

impl Drop for Passing<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Serve `conn` until it closes.
pub async fn serve(setup: Arc<Setup>, mut conn: Conn) {
    let limits = &setup.limits;
    if fds_nearly_gone(&conn.stream) {
        return refuse_for_fds(conn, limits).await;
    }
    let mut upstream: Option<Upstream> = None;
    // A fresh connection may wait the read timeout for its first request (as uvicorn's read
    // timer allows); between requests, the keep-alive timeout.
    let mut idle = limits.read_timeout;
    // Requests the client sent before the one ahead of them was answered, in a row.
    let mut pipelined = 0;
    loop {
        pipelined = if conn.buffered.is_empty() {
            0
        } else {
            pipelined + 1
        };
        if pipelined > MAX_PIPELINE {
            // guard.py's bound: those queued are answered, the rest never read.
            return http::linger(conn).await;
        }
        if !conn.express {
            // Bytes first (an idle connection holds no turn), then the turn, then the read.
            if conn.buffered.is_empty() && !arrives_within(&mut conn, idle).await {
                return;
            }
            setup.intake.turn().await;
        }
        let head = match http::read_head(&mut conn, limits, idle).await {
            Ok(head) => head,
            Err(Ending::Closed) => return,
            Err(Ending::Refused(refusal)) => return http::refuse(conn, refusal).await,
        };
        idle = limits.keep_alive_timeout;
        let native = setup.native.read().expect("never poisoned").clone();
        let (request, body) = match native.filter(|_| governed(&head.request)) {
            Some(native) => match take(native, head, conn, limits).await {
                Step::Next(next) => {
                    conn = next;
                    continue;
                }
                Step::Linger(last) => return http::linger(last).await,
                Step::Refuse(last, refusal) => return http::refuse(last, refusal).await,
                Step::Gone => return,
                Step::Pass(request, body, back) => {
                    conn = back;
                    (request, body)
                }
            },
            None => (head.request, Body::Wire(head.framing)),
        };
        let app = Path::new(&setup.app);
        let passing = Passing::new(&setup.passing);
        let after = pass::forward(app, &mut upstream, &mut conn, &request, body, limits).await;
        drop(passing);
        match after {
            After::KeepAlive => {}
            After::Close => return http::linger(conn).await,
            After::Drop => return,
        }
    }
}

/// Wait until the client has sent something (read into `conn.buffered`), closed, or sent
/// nothing for `idle` (false: the connection is closed, as `read_head` closes it). The bytes
/// are read, not only awaited: tokio may call a fresh socket readable with nothing to read,
/// and a turn taken then would be spent on a wait, not on a request.
async fn arrives_within(conn: &mut Conn, idle: std::time::Duration) -> bool {
    let deadline = tokio::time::Instant::now() + idle;
    loop {
        if !matches!(
            tokio::time::timeout_at(deadline, conn.stream.readable()).await,
            Ok(Ok(()))
        ) {
            return false;
        }
        match conn.stream.try_read_buf(&mut conn.buffered) {
            // Bytes, or the client's end (the read that follows sees it too).
            Ok(_) => return true,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => return false,
        }
    }
}

const FD_RESERVE: u64 = 64; // guard.py's: descriptors kept for backends, scrapes, the relay

/// Descriptors are handed out lowest first: a number this high means few are left.
fn fds_nearly_gone(stream: &tokio::net::TcpStream) -> bool {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given and nothing else.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut limit) } != 0 {
        return false;
    }
    let fd = u64::try_from(stream.as_raw_fd()).unwrap_or(0);
    fd.saturating_add(FD_RESERVE) >= limit.rlim_cur
}

/// guard.py's answer to a connection accepted with descriptors nearly gone: a 503 once the
/// client sends (a connection that sends nothing is closed by the read timeout), then close.
async fn refuse_for_fds(mut conn: Conn, limits: &Limits) {
    let read = tokio::time::timeout(
        limits.read_timeout,
        conn.stream.read_buf(&mut conn.buffered),
    );
    if let Ok(Ok(n)) = read.await {
        if n > 0 {
            let answer = answer(Refusal::OutOfFds, std::time::SystemTime::now());
            let _ = conn.stream.write_all(&answer).await;
        }
    }
}

/// A request on a governed route that the front takes: any method but a WebSocket handshake
/// (the app's to answer, as it answers one on any route). Another upgrade (`h2c`) is ignored,
/// as an HTTP/1.1 server may: the request is served as if it asked none.
fn governed(request: &Request) -> bool {
    let websocket = request
        .header("upgrade")
        .is_some_and(|value| http::tokens(value).any(|t| t.eq_ignore_ascii_case(b"websocket")));
    NATIVE_PATHS.contains(&request.path()) && !websocket
}

/// What became of a governed request.
enum Step {
    /// Answered: the connection's next request.
    Next(Conn),
    /// Answered, and the connection ends: linger, then close.
    Linger(Conn),
    /// Answer this refusal below the app, then close.
    Refuse(Conn, Refusal),
    /// The connection is gone, or ended already.
    Gone,
    /// The app's to serve: the request, its body, the connection.
    Pass(Request, Body, Conn),
}

const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n"; // uvicorn's, as the app reads

/// A governed request, answered as the app answers it, in the app's order: its middleware's
/// (the native server's `screen`: a foreign Host or Origin's 403, a declared length over the
/// limit's 413, a compressed body's 415, the connection closed), the router's 405 for a method
/// other than POST, a bad key's 401; only then is the body read (uvicorn's `100 Continue` first when asked), a chunked
/// one decoded and answered 413 once its data passes the limit, and the request served as
/// one of a declared length is. What the app answered before reading is read past, as
/// uvicorn's parser does, and the connection goes on.
async fn take(native: Arc<dyn Native>, head: http::Head, mut conn: Conn, limits: &Limits) -> Step {
    let http::Head {
        mut request,
        framing,
        deadline,
    } = head;
    let screen = native.screen(&request, limits.max_body_bytes);
    if let Screen::Close(answer) = &screen {
        return match conn.stream.write_all(headed(answer, &request)).await {
            Ok(()) => Step::Linger(conn),
            Err(_) => Step::Gone,
        };
    }
    let now = SystemTime::now();
    let early = match screen {
        _ if request.method != "POST" => Some(method_not_allowed()),
        Screen::Refuse(error) => Some(error),
        _ => None,
    };
    if let Some(error) = early {
        let answer = app_error(&error, request.keep_alive, now);
        return answered(
            conn,
            headed(&answer, &request),
            request.keep_alive,
            Unwanted::whole(framing),
            deadline,
        )
        .await;
    }
    let continued = expects_continue(&request);
    if continued && conn.stream.write_all(CONTINUE).await.is_err() {
        return Step::Gone;
    }
    let read = match framing {
        Framing::Length(n) => http::read_body(&mut conn, n as usize, deadline)
            .await
            .map_err(Unread::Ending),
        Framing::Chunked => http::read_chunked(&mut conn, limits.max_body_bytes, deadline).await,
    };
    request.body = match read {
        Ok(body) => body,
        Err(Unread::Ending(Ending::Closed)) => return Step::Gone,
        Err(Unread::Ending(Ending::Refused(refusal))) => return Step::Refuse(conn, refusal),
        Err(Unread::TooLarge(rest)) => {
            let error = body_too_large(limits.max_body_bytes);
            let answer = app_error(&error, request.keep_alive, now);
            let rest = Unwanted::Chunked(rest);
            return answered(conn, &answer, request.keep_alive, rest, deadline).await;
        }
    };
    let keep_alive = request.keep_alive;
    match native.serve(request, conn).await {
        Outcome::Served(Some(next)) if keep_alive => Step::Next(next),
        Outcome::Served(Some(last)) => Step::Linger(last),
        Outcome::Served(None) => Step::Gone,
        Outcome::Declined(declined, back) => {
            Step::Pass(for_the_app(declined, framing, continued), Body::Read, back)
        }
    }
}

/// After an answer the app gave before reading the body: the rest of the body read past on a
/// kept-alive connection (the next request follows it), or the connection ended (uvicorn
/// closes it lingering, the body unread).
async fn answered(
    mut conn: Conn,
    answer: &[u8],
    keep_alive: bool,
    rest: Unwanted,
    deadline: tokio::time::Instant,
) -> Step {
    if conn.stream.write_all(answer).await.is_err() {
        return Step::Gone;
    }
    if !keep_alive {
        return Step::Linger(conn);
    }
    match http::skip_body(&mut conn, rest, deadline).await {
        Ok(()) => Step::Next(conn),
        Err(Ending::Closed) => Step::Gone,
        Err(Ending::Refused(refusal)) => Step::Refuse(conn, refusal),
    }
}

/// A declined request as the app gets it, its body read already: a chunked one sent as one
/// chunk (the client's headers kept; its trailers, which the app never reads, dropped), and
/// no `Expect` once the front has sent the `100 Continue` (the app would send a second).
fn for_the_app(mut request: Request, framing: Framing, continued: bool) -> Request {
    if framing == Framing::Chunked {
        let mut body = format!("{:x}\r\n", request.body.len()).into_bytes();
        if request.body.is_empty() {
            body.extend_from_slice(b"\r\n");
        } else {
            body.extend_from_slice(&request.body);
            body.extend_from_slice(b"\r\n0\r\n\r\n");
        }
        request.body = body.into();
    }
    if continued {
        request.headers.retain(|(name, _)| name != "expect");
    }
    request
}

/// uvicorn sends `100 Continue` when the app first reads a body whose request asked for it.
fn expects_continue(request: &Request) -> bool {
    request.headers.iter().any(|(name, value)| {
        name == "expect" && value.trim_ascii().eq_ignore_ascii_case(b"100-continue")
    })
}

const CODE_TOO_LARGE: &str = "body_too_large";

/// `BodyLimit`'s 413 (`middleware._message`).
fn body_too_large(limit: usize) -> ErrorReply {
    ErrorReply::checks(
        413,
        super::middleware::too_large(limit),
        CODE_TOO_LARGE,
        None,
    )
}

/// The router's 405 for a governed path (each is POST only), through `errors._on_http_error`.
fn method_not_allowed() -> ErrorReply {
    let mut error =
        ErrorReply::checks(405, "Method Not Allowed".into(), "method_not_allowed", None);
    error.headers = vec![("allow".into(), "POST".into())];
    error
}

/// A response as uvicorn writes it to `request`: to a HEAD, its head alone.
fn headed<'a>(response: &'a [u8], request: &Request) -> &'a [u8] {
    if request.method != "HEAD" {
        return response;
    }
    let head = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(response.len(), |at| at + 4);
    &response[..head]
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    fn request(method: &str, target: &str, headers: &[(&str, &str)]) -> Request {
        Request {
            method: method.into(),
            target: target.into(),
            version: 1,
            headers: headers
                .iter()
                .map(|(n, v)| ((*n).into(), v.as_bytes().to_vec()))
                .collect(),
            body: Bytes::new(),
            keep_alive: true,
        }
    }

    // Every method on a governed path is the front's, but a WebSocket handshake; other paths
    // are not.
    #[test]
    fn governed_paths_but_websocket_handshakes() {
        let on = |m: &str, t: &str, h: &[(&str, &str)]| governed(&request(m, t, h));
        assert!(on("POST", "/v1/chat/completions", &[]));
        assert!(on("POST", "/v1/completions?x=1", &[]));
        assert!(on("GET", "/v1/responses", &[]));
        assert!(on("POST", "/v1/completions", &[("expect", "100-continue")]));
        assert!(!on("POST", "/v1/embeddings", &[]));
        assert!(!on("POST", "/v1/completions/", &[]));
        assert!(on("POST", "/v1/completions", &[("upgrade", "h2c")]));
        assert!(!on("GET", "/v1/responses", &[("upgrade", "websocket")]));
        assert!(!on(
            "GET",
            "/v1/responses",
            &[("upgrade", "foo, WebSocket")]
        ));
    }

    // `100 Continue` is asked by `Expect: 100-continue` alone (uvicorn ignores other values).
    #[test]
    fn continue_asked() {
        let asks = |v: &str| expects_continue(&request("POST", "/", &[("expect", v)]));
        assert!(asks("100-continue"));
        assert!(asks("100-Continue "));
        assert!(!asks("foo"));
        assert!(!expects_continue(&request("POST", "/", &[])));
    }

    // A declined chunked body goes to the app as one chunk, its headers as the client sent
    // them, less the `Expect` the front answered.
    #[test]
    fn declined_as_the_app_reads_it() {
        let headers = [("transfer-encoding", "chunked"), ("expect", "100-continue")];
        let mut declined = request("POST", "/v1/completions", &headers);
        declined.body = Bytes::from_static(b"0123456789abcdefg");
        let sent = for_the_app(declined.clone(), Framing::Chunked, true);
        assert_eq!(sent.body.as_ref(), b"11\r\n0123456789abcdefg\r\n0\r\n\r\n");
        assert_eq!(
            sent.headers,
            [("transfer-encoding".into(), b"chunked".to_vec())]
        );
        let mut empty = declined.clone();
        empty.body = Bytes::new();
        let sent = for_the_app(empty, Framing::Chunked, false);
        assert_eq!(sent.body.as_ref(), b"0\r\n\r\n");
        assert_eq!(sent.headers.len(), 2);
        let sized = for_the_app(declined.clone(), Framing::Length(17), false);
        assert_eq!(sized, declined);
    }

    // The 405 and the 413s as the app writes them (recorded through uvicorn, `date` aside).
    #[test]
    fn the_apps_answers() {
        let at = std::time::UNIX_EPOCH;
        let date = "date: Thu, 01 Jan 1970 00:00:00 GMT\r\n";
        let kept = app_error(&method_not_allowed(), true, at);
        assert_eq!(
            String::from_utf8(kept.clone()).unwrap(),
            format!(
                "HTTP/1.1 405 Method Not Allowed\r\n{date}server: uvicorn\r\nallow: POST\r\n\
                 x-llmflow-reason: method_not_allowed\r\ncontent-length: 114\r\n\
                 content-type: application/json\r\n\r\n{{\"error\":{{\"message\":\
                 \"Method Not Allowed\",\"type\":\"invalid_request_error\",\
                 \"code\":\"method_not_allowed\",\"param\":null}}}}"
            )
        );
        let head = request("HEAD", "/v1/completions", &[]);
        assert_eq!(headed(&kept, &head), &kept[..kept.len() - 114]);
        assert_eq!(headed(&kept, &request("GET", "/", &[])), &kept[..]);
        let counted = app_error(&body_too_large(2048), true, at);
        assert!(String::from_utf8(counted).unwrap().ends_with(
            "content-length: 153\r\ncontent-type: application/json\r\n\r\n{\"error\":\
             {\"message\":\"request body is larger than the gateway's limit of 2048 bytes\",\
             \"type\":\"invalid_request_error\",\"code\":\"body_too_large\",\"param\":null}}"
        ));
    }
}
