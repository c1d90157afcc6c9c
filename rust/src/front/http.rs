//! HTTP/1.1 requests off a client's socket, with the gateway's limits, answered as the Python
//! path answers them.
//!
//! Today's listener (`gateway/handoff.py`, uvicorn with httptools) bounds a request's line and
//! headers (`limits.max_header_bytes`: 431 `headers_too_large`), answers bytes it cannot parse
//! with 400 `invalid_http`, and a request not received within `server.read_timeout_ms` with
//! 408 `request_timeout`; each with an OpenAI-style body and `connection: close`, after which
//! it lingers (reads and drops what the client still sends) so the client reads the answer
//! rather than a reset. This module writes the same bytes. Everything about a body past its
//! framing (413 `body_too_large`, 415) is the app's: its middleware answers it, through the
//! pass-through, exactly as before.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{Buf, Bytes};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::{timeout_at, Instant};

use super::{Conn, Request};

/// The bounds a request is read within (`limits.max_header_bytes`, `server.max_body_bytes`,
/// `server.read_timeout_ms`).
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_header_bytes: usize,
    pub max_body_bytes: usize,
    /// A request's head and body, from its first byte (slowloris): 408.
    pub read_timeout: Duration,
    /// Between requests on a kept-alive connection: closed quietly (uvicorn's 5 s).
    pub keep_alive_timeout: Duration,
}

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

/// An answer below the app, as `handoff.py` writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    HeadTooLarge(usize),
    Invalid,
    TimedOut,
}

const HEADER_OVERHEAD: usize = 4; // ": " and CRLF around each header, as handoff.py counts
const LINGER: Duration = Duration::from_secs(2); // handoff.py's _LINGER_S
const TIMED_OUT: &[u8] = b"{\"error\":{\"message\":\"the request was not received in time: send \
    the headers and the body without pausing\",\"type\":\"invalid_request_error\",\"param\":null,\
    \"code\":\"request_timeout\"}}";
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
    // handoff.py's measure of a complete head: the target and each header with its overhead.
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

/// Write `refusal`'s answer, then linger and close (`handoff.py`'s `_send_error`).
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
    let mut sink = [0u8; 8192];
    while let Ok(Ok(n)) = timeout_at(until, conn.stream.read(&mut sink)).await {
        if n == 0 {
            break;
        }
    }
}

/// The bytes of `refusal`'s answer, as the Python path writes them.
pub fn answer(refusal: Refusal, now: SystemTime) -> Vec<u8> {
    match refusal {
        Refusal::HeadTooLarge(limit) => {
            let message = format!(
                "request line and headers are larger than the gateway's limit of {limit} bytes \
                 (limits.max_header_bytes): send fewer or shorter headers"
            );
            uvicorn_error(
                431,
                "Request Header Fields Too Large",
                &message,
                "headers_too_large",
                now,
            )
        }
        Refusal::Invalid => uvicorn_error(
            400,
            "Bad Request",
            "Invalid HTTP request received. Send a well-formed HTTP/1.1 request.",
            "invalid_http",
            now,
        ),
        Refusal::TimedOut => {
            // handoff.py's _error_response with its _TIMED_OUT body: no uvicorn headers there.
            let mut out = b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n\
                x-llmflow-reason: request_timeout\r\nconnection: close\r\n"
                .to_vec();
            out.extend_from_slice(
                format!("content-length: {}\r\n\r\n", TIMED_OUT.len()).as_bytes(),
            );
            out.extend_from_slice(TIMED_OUT);
            out
        }
    }
}

// handoff.py's `_send_error`: uvicorn's default headers (date, server), the reason, the body.
fn uvicorn_error(status: u16, phrase: &str, message: &str, code: &str, now: SystemTime) -> Vec<u8> {
    let body = error_json(status, message, code);
    let mut out = format!(
        "HTTP/1.1 {status} {phrase}\r\ndate: {}\r\nserver: uvicorn\r\nx-llmflow-reason: {code}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        http_date(now),
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    out
}

/// `errors.py`'s `error_bytes`: `json.dumps(error_body(...))`, with its separators.
pub fn error_json(status: u16, message: &str, code: &str) -> Vec<u8> {
    let kind = match status {
        401 => "authentication_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        499 => "client_closed_request",
        502 => "bad_gateway",
        503 => "service_unavailable",
        504 => "timeout_error",
        s if s >= 500 => "server_error",
        _ => "invalid_request_error",
    };
    format!(
        "{{\"error\": {{\"message\": {}, \"type\": \"{kind}\", \"code\": {}, \"param\": null}}}}",
        json_string(message),
        json_string(code)
    )
    .into_bytes()
}

// Python's json.dumps of a str (ensure_ascii): escapes quotes, backslashes, controls, non-ASCII.
fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
        }
    }
    out.push('"');
    out
}

/// An IMF-fixdate (`Sat, 05 Dec 2026 12:05:27 GMT`), as uvicorn's `date` header.
pub fn http_date(now: SystemTime) -> String {
    const DAYS: [&str; 7] = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"];
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil_from_days, on days since 1970-01-01 (a Thursday).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{}, {day:02} {} {year} {:02}:{:02}:{:02} GMT",
        DAYS[(days % 7) as usize],
        MONTHS[(month - 1) as usize],
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}
