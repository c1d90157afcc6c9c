//! The bytes of the answers the front writes itself, as the Python path writes them: below
//! the app (`gateway/guard.py`'s `_send_error` and `_error_response`), with uvicorn's default
//! headers where uvicorn's protocol adds them, so a client cannot tell which path answered.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use super::http::Refusal;

const OUT_OF_FDS: &[u8] =
    b"{\"error\":{\"message\":\"the gateway has no file descriptors left for \
    new connections; retry shortly\",\"type\":\"server_error\",\"param\":null,\
    \"code\":\"too_many_connections\"}}";
const TIMED_OUT: &[u8] = b"{\"error\":{\"message\":\"the request was not received in time: send \
    the headers and the body without pausing\",\"type\":\"invalid_request_error\",\"param\":null,\
    \"code\":\"request_timeout\"}}";

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
            python_error("408 Request Timeout", TIMED_OUT, "request_timeout", None)
        }
        Refusal::OutOfFds => python_error(
            "503 Service Unavailable",
            OUT_OF_FDS,
            "too_many_connections",
            Some(1),
        ),
    }
}

// guard.py's `_error_response`: no uvicorn headers; Retry-After when given (a refusal no
// runtime priced: guard.py's TRANSPORT_RETRY_AFTER_S).
fn python_error(status: &str, body: &[u8], code: &str, retry_after: Option<u32>) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\nx-llmflow-reason: {code}\r\n"
    );
    if let Some(seconds) = retry_after {
        let _ = write!(out, "retry-after: {seconds}\r\n");
    }
    let _ = write!(
        out,
        "connection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let mut out = out.into_bytes();
    out.extend_from_slice(body);
    out
}

// guard.py's `_send_error`: uvicorn's default headers (date, server), the reason, the body.
pub fn uvicorn_error(
    status: u16,
    phrase: &str,
    message: &str,
    code: &str,
    now: SystemTime,
) -> Vec<u8> {
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

/// The app's `GatewayError` answer (its `response()`) as uvicorn writes it: the server's
/// `date` and `server` first, `connection: close` unless the connection goes on.
pub fn app_error(error: &super::reply::ErrorReply, keep_alive: bool, now: SystemTime) -> Vec<u8> {
    let date = http_date(now);
    let defaults: [(&[u8], &[u8]); 2] = [(b"date", date.as_bytes()), (b"server", b"uvicorn")];
    error.response_bytes(&defaults, keep_alive)
}

/// `errors.py`'s `error_bytes`: `json.dumps(error_body(...))`, with its separators.
pub fn error_json(status: u16, message: &str, code: &str) -> Vec<u8> {
    let kind = super::reply::error_type(status);
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
                    let _ = write!(out, "\\u{unit:04x}");
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    // The date as uvicorn writes it (email.utils.formatdate(usegmt=True)).
    #[test]
    fn imf_fixdate() {
        let at = |s: u64| http_date(UNIX_EPOCH + Duration::from_secs(s));
        assert_eq!(at(0), "Thu, 01 Jan 1970 00:00:00 GMT");
        assert_eq!(at(1_796_472_327), "Sat, 05 Dec 2026 12:05:27 GMT");
        assert_eq!(at(951_782_400), "Tue, 29 Feb 2000 00:00:00 GMT");
    }

    // json.dumps(error_body(...)): its separators, key order and ASCII escapes.
    #[test]
    fn error_json_as_python_dumps() {
        let body = error_json(431, "a \"b\" \\ é\n", "headers_too_large");
        assert_eq!(
            String::from_utf8(body).unwrap(),
            r#"{"error": {"message": "a \"b\" \\ \u00e9\n", "type": "invalid_request_error", "code": "headers_too_large", "param": null}}"#
        );
        assert!(String::from_utf8(error_json(502, "x", "y"))
            .unwrap()
            .contains("\"bad_gateway\""));
    }

    // The 408 has guard.py's own compact body and no uvicorn headers.
    #[test]
    fn timed_out_bytes() {
        let out = String::from_utf8(answer(Refusal::TimedOut, UNIX_EPOCH)).unwrap();
        assert!(
            out.starts_with("HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n")
        );
        assert!(out.ends_with(
            r#"pausing","type":"invalid_request_error","param":null,"code":"request_timeout"}}"#
        ));
        assert!(!out.contains("server:"));
    }
}
