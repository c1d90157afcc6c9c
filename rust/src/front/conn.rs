//! One client connection's life: read a request, offer it to the native server or pass it to
//! the app, answer in order, keep the connection alive while both sides agree.
//!
//! Requests on one connection are served one after another, so pipelined requests are
//! answered in order: what a client sent ahead waits in `Conn::buffered` (read ahead while
//! the current reply is written) and is parsed when the reply is done.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use std::os::fd::AsRawFd;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::answer::answer;
use super::http::{self, Ending, Framing, Limits, Refusal};
use super::pass::{self, After, Body, Upstream};
use super::{Conn, Native, Outcome, Request};

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
        let head = match http::read_head(&mut conn, limits, idle).await {
            Ok(head) => head,
            Err(Ending::Closed) => return,
            Err(Ending::Refused(refusal)) => return http::refuse(conn, refusal).await,
        };
        idle = limits.keep_alive_timeout;
        let mut request = head.request;
        let mut body = Body::Wire(head.framing);
        let native = setup.native.read().expect("never poisoned").clone();
        if let (Some(native), Some(length)) = (native, offered(&request, head.framing, limits)) {
            request.body = match http::read_body(&mut conn, length, head.deadline).await {
                Ok(read) => read,
                Err(Ending::Closed) => return,
                Err(Ending::Refused(refusal)) => return http::refuse(conn, refusal).await,
            };
            let keep_alive = request.keep_alive;
            match native.serve(request, conn).await {
                Outcome::Served(Some(next)) if keep_alive => {
                    conn = next;
                    continue;
                }
                Outcome::Served(Some(last)) => return http::linger(last).await,
                Outcome::Served(None) => return,
                Outcome::Declined(declined, back) => {
                    (request, conn) = (declined, back);
                    body = Body::Read;
                }
            }
        }
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

/// The body length of a request the native server is offered, or None: a governed route,
/// `POST`, a body of a declared length within the limit, nothing that changes how the
/// exchange goes (`Expect`, `Upgrade`); the app serves everything else as before.
fn offered(request: &Request, framing: Framing, limits: &Limits) -> Option<usize> {
    let Framing::Length(length) = framing else {
        return None;
    };
    let plain = request.method == "POST"
        && NATIVE_PATHS.contains(&request.path())
        && request.header("content-length").is_some()
        && request.header("expect").is_none()
        && request.header("upgrade").is_none();
    let length = usize::try_from(length).ok()?;
    (plain && length <= limits.max_body_bytes).then_some(length)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

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

    fn limits() -> Limits {
        Limits {
            max_header_bytes: 8192,
            max_body_bytes: 100,
            read_timeout: Duration::from_secs(1),
            keep_alive_timeout: Duration::from_secs(1),
            write_timeout: Duration::from_secs(1),
        }
    }

    // Only a plain POST to a governed route, with a declared body within the limit, is offered.
    #[test]
    fn offered_only_plain_governed_posts() {
        let cl = ("content-length", "10");
        let l = limits();
        let post =
            |t: &str, h: &[(&str, &str)]| offered(&request("POST", t, h), Framing::Length(10), &l);
        assert_eq!(post("/v1/chat/completions", &[cl]), Some(10));
        assert_eq!(post("/v1/completions?x=1", &[cl]), Some(10));
        assert_eq!(post("/v1/responses", &[cl]), Some(10));
        assert_eq!(post("/v1/embeddings", &[cl]), None);
        assert_eq!(post("/v1/chat/completions", &[]), None);
        assert_eq!(
            post("/v1/chat/completions", &[cl, ("expect", "100-continue")]),
            None
        );
        assert_eq!(
            post("/v1/chat/completions", &[cl, ("upgrade", "h2c")]),
            None
        );
        let get = request("GET", "/v1/completions", &[cl]);
        assert_eq!(offered(&get, Framing::Length(10), &l), None);
        let chunked = request(
            "POST",
            "/v1/completions",
            &[("transfer-encoding", "chunked")],
        );
        assert_eq!(offered(&chunked, Framing::Chunked, &l), None);
        let big = request("POST", "/v1/completions", &[("content-length", "101")]);
        assert_eq!(offered(&big, Framing::Length(101), &l), None);
    }
}
