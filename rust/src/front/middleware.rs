//! What the app's middleware answers before any route reads a request (`gateway/middleware.py`):
//! a keyless gateway's `HostGuard` and `BodyLimit`'s walk of the headers, in the app's order,
//! with the bytes uvicorn writes for them. The front asks it of every governed request before
//! it reads the body (`Native::screen`), so the app's middleware never sees one.

use super::Request;

/// `BodyLimit`'s 413 message (`middleware._message`): for a declared length here, and for a
/// chunked body whose data passes the limit as it is read (`conn.rs`).
pub fn too_large(limit: usize) -> String {
    format!("request body is larger than the gateway's limit of {limit} bytes")
}

/// What the app's middleware answers a request with before any route reads it, in its order:
/// a keyless gateway's (`own_hosts`) `HostGuard` (403 `forbidden_origin`), then `BodyLimit`'s
/// walk of the headers, the first that fails in their order: a `Content-Length` past
/// `max_body_bytes` (413 `body_too_large`; None: the body was read within the limit) or a
/// `Content-Encoding` other than identity (415 `unsupported_content_encoding`). The bytes are
/// uvicorn's of the middleware's `_send_error` (`connection: close`); the connection closes.
pub fn middleware_answer(
    request: &Request,
    own_hosts: Option<&[String]>,
    max_body_bytes: Option<usize>,
) -> Option<Vec<u8>> {
    let now = std::time::SystemTime::now();
    if let Some(own) = own_hosts {
        let (host, origin) = (request.header("host"), request.header("origin"));
        let allowed = |name: &str| own.iter().any(|n| n == name);
        if let Some(reason) = super::origin::foreign_request(host, origin, allowed) {
            let answer = super::answer::uvicorn_error;
            return Some(answer(403, "Forbidden", &reason, "forbidden_origin", now));
        }
    }
    for (name, value) in &request.headers {
        if name == "content-length" {
            let Some(limit) = max_body_bytes else {
                continue;
            };
            // `value.isdigit() and int(value) > max_bytes`: ASCII digits, of any length.
            let digits = !value.is_empty() && value.iter().all(u8::is_ascii_digit);
            let first = value.iter().position(|&b| b != b'0').unwrap_or(value.len());
            let significant = &value[first..]; // past 20 digits, past any usize
            let over = significant.len() > 20
                || std::str::from_utf8(significant)
                    .ok()
                    .and_then(|v| v.parse::<u128>().ok())
                    .is_some_and(|n| n > limit as u128);
            if digits && over {
                let message = too_large(limit);
                let answer = super::answer::uvicorn_error;
                let phrase = "Request Entity Too Large";
                return Some(answer(413, phrase, &message, "body_too_large", now));
            }
        } else if name == "content-encoding"
            && !matches!(
                super::pytext::strip_bytes(value)
                    .to_ascii_lowercase()
                    .as_slice(),
                b"" | b"identity"
            )
        {
            let shown = super::pytext::repr_latin1(&value[..value.len().min(40)]);
            let message = format!("Content-Encoding {shown} is not supported: send plain JSON");
            let code = "unsupported_content_encoding";
            let phrase = "Unsupported Media Type";
            return Some(super::answer::uvicorn_error(
                415, phrase, &message, code, now,
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(headers: &[(&str, &[u8])]) -> Request {
        Request {
            method: "POST".into(),
            target: "/v1/chat/completions".into(),
            version: 1,
            headers: headers
                .iter()
                .map(|(n, v)| ((*n).into(), v.to_vec()))
                .collect(),
            body: bytes::Bytes::new(),
            keep_alive: true,
        }
    }

    fn answered(headers: &[(&str, &[u8])], own: Option<&[String]>) -> Option<String> {
        let answer = middleware_answer(&request(headers), own, Some(100))?;
        let text = String::from_utf8(answer).expect("ASCII");
        let status = text[9..12].to_owned();
        let body = &text[text.find("\r\n\r\n").expect("a head") + 4..];
        let message = body.split("\"message\": \"").nth(1).expect("a message");
        Some(format!(
            "{status} {}",
            &message[..message.find('"').expect("its end")]
        ))
    }

    // The app's order: HostGuard first, then BodyLimit's walk, the first header that fails.
    #[test]
    fn the_middlewares_order() {
        let own = vec!["localhost".to_owned()];
        let own = Some(own.as_slice());
        let (big, gzip) = (
            ("content-length", b"101".as_slice()),
            ("content-encoding", b"gzip".as_slice()),
        );
        let foreign = ("host", b"evil.example".as_slice());
        let too_large = "413 request body is larger than the gateway's limit of 100 bytes";
        let encoded = "415 Content-Encoding 'gzip' is not supported: send plain JSON";
        assert_eq!(answered(&[big, gzip], own).as_deref(), Some(too_large));
        assert_eq!(answered(&[gzip, big], own).as_deref(), Some(encoded));
        let refused = answered(&[big, gzip, foreign], own).expect("refused");
        assert!(refused.starts_with("403 Host 'evil.example'"), "{refused}");
        // Keys configured: no HostGuard.
        assert_eq!(answered(&[foreign, big], None).as_deref(), Some(too_large));
        // Within the limit, leading zeros and all; identity in any case; a length that is
        // not digits is not BodyLimit's.
        let fine: [(&str, &[u8]); 4] = [
            ("content-length", b"0000000000000000000000100"),
            ("content-encoding", b" Identity\x0b"),
            ("content-length", b"+101"),
            ("content-encoding", b""),
        ];
        assert_eq!(answered(&fine, own), None);
        let huge = (
            "content-length",
            b"99999999999999999999999999999999999999999999".as_slice(),
        );
        assert_eq!(answered(&[huge], own).as_deref(), Some(too_large));
    }
}
