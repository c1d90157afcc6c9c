//! HTTP/1.1 requests off a client's socket, with the gateway's limits, answered as the Python
//! path answers them.
//!
//! The Python listener (`gateway/guard.py`, uvicorn with httptools; on the port before the front,
//! on the app's private socket and the admin port now) bounds a request's line and
//! headers (`limits.max_header_bytes`: 431 `headers_too_large`), answers bytes it cannot parse
//! with 400 `invalid_http`, and a request not received within `server.read_timeout_ms` with
//! 408 `request_timeout`; each with an OpenAI-style body and `connection: close`, after which
//! it lingers (reads and drops what the client still sends) so the client reads the answer
//! rather than a reset. This module writes the same bytes. It reads a governed request's body
//! as uvicorn does for the app (a declared length, or chunks decoded within
//! `server.max_body_bytes`: `chunked::Decoder`), and reads past one nobody will read (the app
//! answered before reading it) as uvicorn's parser does before the next request.

use std::time::{Duration, SystemTime};

use bytes::{Buf, Bytes};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::{timeout_at, Instant};

use super::answer::answer;
use super::chunked::Decoder;
use super::{Conn, Request};

/// The bounds a request is read and answered within (`limits.max_header_bytes`,
/// `server.max_body_bytes`, `server.read_timeout_ms`, `server.write_timeout_ms`).
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_header_bytes: usize,
    pub max_body_bytes: usize,
    /// A request's head and body, from its first byte (slowloris): 408.
    pub read_timeout: Duration,
    /// Between requests on a kept-alive connection: closed quietly (uvicorn's 5 s).
    pub keep_alive_timeout: Duration,
    /// A client that takes none of a reply's bytes this long is dropped (the Python
    /// listener's write timer): it holds no fd or buffer for ever.
    pub write_timeout: Duration,
}

/// uvicorn's `timeout_keep_alive`, which the Python listener runs with.
pub const KEEP_ALIVE: Duration = Duration::from_secs(5);

/// How a request's body is framed on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    Length(u64),
    Chunked,
}

/// A request's head, its body not read yet.
#[derive(Debug)]
pub struct Head {
    pub request: Request,
    pub framing: Framing,
    /// When the request must be in whole (its first byte plus the read timeout).
    pub deadline: Instant,
}

/// Why no request came.
#[derive(Debug, PartialEq, Eq)]
pub enum Ending {
    /// The client closed, or sat idle: close quietly.
    Closed,
    /// Answer with this error and close.
    Refused(Refusal),
}

/// An answer below the app, as `guard.py` writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    HeadTooLarge(usize),
    Invalid,
    TimedOut,
    /// File descriptors are nearly gone: 503, keeping a reserve for the backends.
    OutOfFds,
}

const HEADER_OVERHEAD: usize = 4; // ": " and CRLF around each header, as guard.py counts
const LINGER: Duration = Duration::from_secs(2); // guard.py's _LINGER_S
const FIRST_HEADERS: usize = 64; // headers parsed before the array is grown

/// Read the next request's head on `conn`; `idle` is how long the client may send nothing.
pub async fn read_head(conn: &mut Conn, limits: &Limits, idle: Duration) -> Result<Head, Ending> {
    let mut deadline = Instant::now() + idle;
    let mut begun = false;
    loop {
        skip_blank_lines(conn);
        if !conn.buffered.is_empty() {
            if !begun {
                begun = true;
                deadline = Instant::now() + limits.read_timeout;
            }
            match parse(&conn.buffered, limits) {
                Ok(Some((len, request, framing))) => {
                    conn.buffered.advance(len);
                    return Ok(Head {
                        request,
                        framing,
                        deadline,
                    });
                }
                Ok(None) if conn.buffered.len() > limits.max_header_bytes => {
                    return Err(Ending::Refused(Refusal::HeadTooLarge(
                        limits.max_header_bytes,
                    )));
                }
                Ok(None) => {}
                Err(refusal) => return Err(Ending::Refused(refusal)),
            }
        }
        match timeout_at(deadline, conn.stream.read_buf(&mut conn.buffered)).await {
            Ok(Ok(0) | Err(_)) => return Err(Ending::Closed),
            Ok(Ok(_)) => {}
            Err(_) if begun => return Err(Ending::Refused(Refusal::TimedOut)),
            Err(_) => return Err(Ending::Closed),
        }
    }
}

/// Read a `Content-Length` body of `length` bytes whole (the head's deadline still holds).
pub async fn read_body(conn: &mut Conn, length: usize, deadline: Instant) -> Result<Bytes, Ending> {
    while conn.buffered.len() < length {
        conn.buffered.reserve(length - conn.buffered.len());
        match timeout_at(deadline, conn.stream.read_buf(&mut conn.buffered)).await {
            Ok(Ok(0) | Err(_)) => return Err(Ending::Closed),
            Ok(Ok(_)) => {}
            Err(_) => return Err(Ending::Refused(Refusal::TimedOut)),
        }
    }
    Ok(conn.buffered.split_to(length).freeze())
}

/// Why a chunked body was not read whole.
#[derive(Debug)]
pub enum Unread {
    Ending(Ending),
    /// Its data passed the limit: the decoder, to read past the rest with (`skip_body`).
    TooLarge(Decoder),
}

/// Read a chunked body whole, its data within `limit` bytes (the head's deadline still holds);
/// malformed framing is refused as uvicorn's parser refuses it (400 `invalid_http`).
pub async fn read_chunked(
    conn: &mut Conn,
    limit: usize,
    deadline: Instant,
) -> Result<Bytes, Unread> {
    let mut decoder = Decoder::new(limit);
    loop {
        if !conn.buffered.is_empty() {
            let used = decoder
                .feed(&conn.buffered)
                .map_err(|_| Unread::Ending(Ending::Refused(Refusal::Invalid)))?;
            conn.buffered.advance(used);
            if decoder.too_large() {
                return Err(Unread::TooLarge(decoder));
            }
            if decoder.done() {
                return Ok(decoder.into_data().into());
            }
        }
        match timeout_at(deadline, conn.stream.read_buf(&mut conn.buffered)).await {
            Ok(Ok(0) | Err(_)) => return Err(Unread::Ending(Ending::Closed)),
            Ok(Ok(_)) => {}
            Err(_) => return Err(Unread::Ending(Ending::Refused(Refusal::TimedOut))),
        }
    }
}

/// A body the app answered before reading: what is left of it on the wire.
#[derive(Debug)]
pub enum Unwanted {
    Length(u64),
    Chunked(Decoder),
}

impl Unwanted {
    /// All of a body of this framing.
    pub fn whole(framing: Framing) -> Self {
        match framing {
            Framing::Length(n) => Self::Length(n),
            Framing::Chunked => Self::Chunked(Decoder::new(0)),
        }
    }
}

/// Read past the rest of a body after its request was answered, as uvicorn's parser does
/// before it reads the next request: bytes that frame badly are its 400 (`Refused`), and a
/// client that stops sending is closed quietly at the request's deadline (its answer went
/// already: the read timer sends no 408 then).
pub async fn skip_body(
    conn: &mut Conn,
    mut rest: Unwanted,
    deadline: Instant,
) -> Result<(), Ending> {
    loop {
        let used = match &mut rest {
            Unwanted::Length(0) => return Ok(()),
            Unwanted::Chunked(decoder) if decoder.done() => return Ok(()),
            Unwanted::Length(left) => {
                let used = (*left).min(conn.buffered.len() as u64);
                *left -= used;
                used as usize
            }
            Unwanted::Chunked(decoder) => decoder
                .feed(&conn.buffered)
                .map_err(|_| Ending::Refused(Refusal::Invalid))?,
        };
        conn.buffered.advance(used);
        let done = matches!(&rest, Unwanted::Length(0))
            || matches!(&rest, Unwanted::Chunked(d) if d.done());
        if done {
            return Ok(());
        }
        match timeout_at(deadline, conn.stream.read_buf(&mut conn.buffered)).await {
            Ok(Ok(0) | Err(_)) | Err(_) => return Err(Ending::Closed),
            Ok(Ok(_)) => {}
        }
    }
}

// Blank lines before a request line are allowed (RFC 9112 2.2), as httptools allows them.
fn skip_blank_lines(conn: &mut Conn) {
    let blank = conn
        .buffered
        .iter()
        .take_while(|b| matches!(b, b'\r' | b'\n'))
        .count();
    conn.buffered.advance(blank);
}

type Parsed = Option<(usize, Request, Framing)>;

/// A complete head: its length, the request and its body's framing; None while incomplete.
fn parse(buf: &[u8], limits: &Limits) -> Result<Parsed, Refusal> {
    let mut room = FIRST_HEADERS;
    loop {
        let mut headers = vec![httparse::EMPTY_HEADER; room];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(buf) {
            Ok(httparse::Status::Complete(len)) => {
                return build(&req, limits).map(|(r, f)| Some((len, r, f)))
            }
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(httparse::Error::TooManyHeaders)
                if room < limits.max_header_bytes / HEADER_OVERHEAD =>
            {
                room *= 4;
            }
            Err(httparse::Error::TooManyHeaders) => {
                return Err(Refusal::HeadTooLarge(limits.max_header_bytes))
            }
            Err(_) => return Err(Refusal::Invalid),
        }
    }
}

fn build(req: &httparse::Request<'_, '_>, limits: &Limits) -> Result<(Request, Framing), Refusal> {
    let (Some(method), Some(target), Some(version)) = (req.method, req.path, req.version) else {
        return Err(Refusal::Invalid);
    };
    // guard.py's measure of a complete head: the target and each header with its overhead.
    let size = target.len()
        + req
            .headers
            .iter()
            .map(|h| h.name.len() + h.value.len() + HEADER_OVERHEAD)
            .sum::<usize>();
    if size > limits.max_header_bytes {
        return Err(Refusal::HeadTooLarge(limits.max_header_bytes));
    }
    let headers: Vec<(String, Vec<u8>)> = req
        .headers
        .iter()
        .map(|h| (h.name.to_ascii_lowercase(), h.value.to_vec()))
        .collect();
    let framing = framing(&headers)?;
    let keep_alive = keep_alive(version, &headers);
    let request = Request {
        method: method.to_owned(),
        target: target.to_owned(),
        version,
        headers,
        body: Bytes::new(),
        keep_alive,
    };
    Ok((request, framing))
}

/// The body's framing (RFC 9112 6.3): chunked last, or one Content-Length; both at once, a
/// length that is not a number or two that differ is a request smuggling risk: 400.
fn framing(headers: &[(String, Vec<u8>)]) -> Result<Framing, Refusal> {
    let mut length: Option<u64> = None;
    let mut codings: Vec<Vec<u8>> = Vec::new();
    for (name, value) in headers {
        match name.as_str() {
            "content-length" => {
                let text = std::str::from_utf8(value)
                    .map_err(|_| Refusal::Invalid)?
                    .trim();
                if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(Refusal::Invalid);
                }
                let n: u64 = text.parse().map_err(|_| Refusal::Invalid)?;
                if length.is_some_and(|m| m != n) {
                    return Err(Refusal::Invalid);
                }
                length = Some(n);
            }
            "transfer-encoding" => codings.extend(tokens(value).map(<[u8]>::to_ascii_lowercase)),
            _ => {}
        }
    }
    match (length, codings.last()) {
        (Some(_), Some(_)) => Err(Refusal::Invalid),
        (_, Some(last)) if last.as_slice() == b"chunked" => Ok(Framing::Chunked),
        (_, Some(_)) => Err(Refusal::Invalid), // a request's body must end by its framing
        (length, None) => Ok(Framing::Length(length.unwrap_or(0))),
    }
}

fn keep_alive(version: u8, headers: &[(String, Vec<u8>)]) -> bool {
    let mut close = false;
    let mut keep = false;
    for (_, value) in headers.iter().filter(|(n, _)| n == "connection") {
        for token in tokens(value) {
            close |= token.eq_ignore_ascii_case(b"close");
            keep |= token.eq_ignore_ascii_case(b"keep-alive");
        }
    }
    !close && (version == 1 || keep)
}

/// The comma-separated tokens of a header value, trimmed.
pub fn tokens(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value
        .split(|&b| b == b',')
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty())
}

/// Write `refusal`'s answer, then linger and close (`guard.py`'s `_send_error`).
pub async fn refuse(mut conn: Conn, refusal: Refusal) {
    let _ = conn
        .stream
        .write_all(&answer(refusal, SystemTime::now()))
        .await;
    linger(conn).await;
}

/// End our side, drop what the client still sends for a moment, close: closing with unread
/// bytes makes the kernel send a reset, which can destroy the answer before it is read.
pub async fn linger(mut conn: Conn) {
    let _ = conn.stream.shutdown().await;
    let until = Instant::now() + LINGER;
    // On the heap, and only while lingering: an array here would sit in every connection's
    // task (its future holds the largest state of any await), idle streams included.
    let mut sink = vec![0u8; 8192];
    while let Ok(Ok(n)) = timeout_at(until, conn.stream.read(&mut sink)).await {
        if n == 0 {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_header_bytes: usize) -> Limits {
        Limits {
            max_header_bytes,
            max_body_bytes: 1 << 20,
            read_timeout: Duration::from_secs(1),
            keep_alive_timeout: Duration::from_secs(1),
            write_timeout: Duration::from_secs(1),
        }
    }

    fn parsed(raw: &[u8]) -> Result<Parsed, Refusal> {
        parse(raw, &limits(4096))
    }

    // A complete head gives its length (the body and what follows are not its), lower-case
    // names in order, raw values, the version and the framing.
    #[test]
    fn complete_head() {
        let raw = b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nX-A: B c\r\n\r\n{}";
        let (len, request, framing) = parsed(raw).unwrap().unwrap();
        assert_eq!(&raw[len..], b"{}");
        assert_eq!(
            (request.method.as_str(), request.path(), request.version),
            ("POST", "/v1/completions", 1)
        );
        let names: Vec<&str> = request.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["host", "content-length", "x-a"]);
        assert_eq!(request.header("x-a"), Some(&b"B c"[..]));
        assert_eq!(framing, Framing::Length(2));
        assert!(request.keep_alive);
        assert_eq!(parsed(&raw[..20]), Ok(None));
    }

    // Keep-alive: HTTP/1.1 unless `close`; HTTP/1.0 only with `keep-alive`.
    #[test]
    fn keep_alive_by_version() {
        let ka = |raw: &[u8]| parsed(raw).unwrap().unwrap().1.keep_alive;
        assert!(ka(b"GET / HTTP/1.1\r\n\r\n"));
        assert!(!ka(b"GET / HTTP/1.1\r\nConnection: foo, Close\r\n\r\n"));
        assert!(!ka(b"GET / HTTP/1.0\r\n\r\n"));
        assert!(ka(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"));
    }

    // Framing: chunked last, or one length; both, two different lengths, a length that is not
    // a number, or a coding other than chunked last are refused (request smuggling).
    #[test]
    fn framing_and_smuggling() {
        let framing = |h: &str| {
            parsed(format!("POST / HTTP/1.1\r\n{h}\r\n").as_bytes()).map(|p| p.unwrap().2)
        };
        assert_eq!(
            framing("Transfer-Encoding: gzip, chunked\r\n"),
            Ok(Framing::Chunked)
        );
        assert_eq!(
            framing("Content-Length: 5\r\nContent-Length: 5\r\n"),
            Ok(Framing::Length(5))
        );
        assert_eq!(framing(""), Ok(Framing::Length(0)));
        for bad in [
            "Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
            "Content-Length: 5\r\nContent-Length: 6\r\n",
            "Content-Length: -1\r\n",
            "Content-Length: 1e3\r\n",
            "Transfer-Encoding: chunked, gzip\r\n",
        ] {
            assert_eq!(framing(bad), Err(Refusal::Invalid), "{bad}");
        }
        assert_eq!(parsed(b"GET / HTTP/2.0\r\n\r\n"), Err(Refusal::Invalid));
        assert_eq!(parsed(b"GET /\x01 HTTP/1.1\r\n\r\n"), Err(Refusal::Invalid));
    }

    // The head's size is measured as guard.py measures it: target plus each header with 4.
    #[test]
    fn head_limit_as_python_counts() {
        let value = "v".repeat(4096 - 1 - 4 - 1);
        let at = format!("GET / HTTP/1.1\r\nx: {value}\r\n\r\n");
        assert!(parse(at.as_bytes(), &limits(4096)).unwrap().is_some());
        let over = format!("GET / HTTP/1.1\r\nx: {value}v\r\n\r\n");
        assert_eq!(
            parse(over.as_bytes(), &limits(4096)),
            Err(Refusal::HeadTooLarge(4096))
        );
        // Many small headers grow the parser's array rather than fail.
        let many = "h: x\r\n".repeat(300);
        let raw = format!("GET / HTTP/1.1\r\n{many}\r\n");
        assert_eq!(
            parse(raw.as_bytes(), &limits(8192))
                .unwrap()
                .unwrap()
                .1
                .headers
                .len(),
            300
        );
    }
}
