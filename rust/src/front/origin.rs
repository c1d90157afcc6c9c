//! `foreign_request` (`gateway/middleware.py`'s `HostGuard`): whether a keyless gateway must not
//! answer a request with this Host and Origin, and the 403's reason.
//!
//! With no key, anything that can reach the port may use it, and a browser reaches a loopback
//! port for any page it shows. DNS rebinding points a page's own name at 127.0.0.1: its
//! requests then carry that name as Host, so a Host that is neither an IP literal nor one of
//! the gateway's own names is refused. A cross-site page sends its own Origin with a POST or a
//! WebSocket upgrade, so an Origin whose host and port are not the request's Host is refused.
//!
//! This is the rule's one home: the front answers its governed routes with it, and the app's
//! `HostGuard` calls it (`_core.front_foreign_request`) for everything the app serves. It reads
//! the headers as Python reads them: their bytes as latin-1 text, `str.lower`, the Host's name
//! as `_host_name` splits it, IP literals as `ipaddress.ip_address` takes them (scope ids,
//! embedded IPv4, no leading zeros), the Origin's netloc as Python 3.11's `urlsplit` finds it,
//! and the reasons' `repr`s. An Origin that `urlsplit` cannot split (an unbalanced or invalid
//! bracketed host) is no same-origin page: refused (Python's `urlsplit` raised there, a 500).

use super::pytext::{repr_latin1, strip_latin1};

/// Why a keyless gateway must not answer a request with this Host and Origin (the first of
/// each header, raw), or None; `allowed`: whether a lower-cased name is one of its own.
pub fn foreign_request(
    host: Option<&[u8]>,
    origin: Option<&[u8]>,
    allowed: impl Fn(&str) -> bool,
) -> Option<String> {
    if let Some(host) = host {
        let name = lower(host_name(host));
        if !name.is_empty() && !is_ip(&name) && !allowed(&latin1(&name)) {
            return Some(format!(
                "Host {} is not a name this gateway answers on: add it to \
                 server.allowed_hosts, or configure API keys",
                repr_latin1(&name)
            ));
        }
    }
    let origin_raw = origin?;
    let same = netloc(strip_latin1(origin_raw))
        .is_some_and(|n| !n.is_empty() && lower(&n) == lower(host.unwrap_or_default()));
    if same {
        return None;
    }
    let shown = &origin_raw[..origin_raw.len().min(100)];
    Some(format!(
        "cross-origin request from {} refused by a gateway without API keys",
        repr_latin1(shown)
    ))
}

/// Latin-1 bytes as text (each byte the code point of its value).
pub fn latin1(text: &[u8]) -> String {
    text.iter().map(|&b| char::from(b)).collect()
}

/// `str.lower()` of latin-1 text: ASCII and `À`..`Þ` (but `×`) shift by 0x20; no other
/// latin-1 character has a lower case, and none lowers out of latin-1.
fn lower(text: &[u8]) -> Vec<u8> {
    text.iter()
        .map(|&b| match b {
            b'A'..=b'Z' | 0xc0..=0xde if b != 0xd7 => b + 0x20,
            _ => b,
        })
        .collect()
}

/// `_host_name`: `[::1]:8080` -> `::1`, `example.com:80` -> `example.com`; a port is what
/// `str.isdigit` holds (the superscripts `²`, `³`, `¹` too), and not empty.
fn host_name(host: &[u8]) -> &[u8] {
    if host.first() == Some(&b'[') {
        return match host.iter().position(|&b| b == b']') {
            Some(end) => &host[1..end],
            None => host,
        };
    }
    let Some(colon) = host.iter().rposition(|&b| b == b':') else {
        return host;
    };
    let (name, port) = (&host[..colon], &host[colon + 1..]);
    let digit = |b: &u8| b.is_ascii_digit() || matches!(b, 0xb2 | 0xb3 | 0xb9);
    if !name.is_empty() && !port.is_empty() && port.iter().all(digit) {
        name
    } else {
        host
    }
}

const HEXTETS: usize = 8; // an IPv6 address's 16-bit groups

/// `ipaddress.ip_address` takes it.
fn is_ip(text: &[u8]) -> bool {
    is_v4(text) || is_v6(text)
}

/// `IPv4Address`: four decimal octets, none past 255, no leading zero.
fn is_v4(text: &[u8]) -> bool {
    let octet = |o: &[u8]| {
        !o.is_empty()
            && o.len() <= 3
            && o.iter().all(u8::is_ascii_digit)
            && (o == b"0" || o[0] != b'0')
            && o.iter().fold(0u32, |n, d| n * 10 + u32::from(d - b'0')) <= 255
    };
    let octets: Vec<&[u8]> = text.split(|&b| b == b'.').collect();
    !text.contains(&b'/') && octets.len() == 4 && octets.iter().all(|o| octet(o))
}

/// `IPv6Address`: a scope id after `%` (not empty, no second `%`), hextets of one to four hex
/// digits, at most one `::`, an IPv4 address as the last two.
fn is_v6(text: &[u8]) -> bool {
    if text.contains(&b'/') {
        return false;
    }
    let addr = match text.iter().position(|&b| b == b'%') {
        Some(at) => {
            let scope = &text[at + 1..];
            if scope.is_empty() || scope.contains(&b'%') {
                return false;
            }
            &text[..at]
        }
        None => text,
    };
    if addr.is_empty() {
        return false;
    }
    let mut parts: Vec<&[u8]> = addr.split(|&b| b == b':').collect();
    if parts.len() < 3 {
        return false;
    }
    if parts.last().is_some_and(|p| p.contains(&b'.')) {
        if !is_v4(parts.pop().expect("three parts")) {
            return false;
        }
        parts.extend([b"0".as_slice(), b"0".as_slice()]); // its two hextets
    }
    if parts.len() > HEXTETS + 1 {
        return false;
    }
    let n = parts.len();
    let mut skip = None;
    for (i, part) in parts.iter().enumerate().take(n - 1).skip(1) {
        if part.is_empty() {
            if skip.is_some() {
                return false; // at most one `::`
            }
            skip = Some(i);
        }
    }
    let (hi, lo) = if let Some(skip) = skip {
        let (mut hi, mut lo) = (skip, n - skip - 1);
        if parts[0].is_empty() {
            hi -= 1;
            if hi > 0 {
                return false; // a leading `:` only as part of `::`
            }
        }
        if parts[n - 1].is_empty() {
            lo -= 1;
            if lo > 0 {
                return false; // a trailing `:` only as part of `::`
            }
        }
        if hi + lo >= HEXTETS {
            return false; // `::` stands for at least one hextet
        }
        (hi, lo)
    } else {
        if n != HEXTETS || parts[0].is_empty() || parts[n - 1].is_empty() {
            return false;
        }
        (n, 0)
    };
    let hextet = |h: &&[u8]| !h.is_empty() && h.len() <= 4 && h.iter().all(u8::is_ascii_hexdigit);
    parts[..hi].iter().all(hextet) && parts[n - lo..].iter().all(hextet)
}

/// The netloc Python 3.11's `urlsplit` finds in a URL (after `//`, up to `/`, `?` or `#`;
/// empty with no `//`), or None where it raises (`Invalid IPv6 URL`, a bracketed host that is
/// neither an IPv6 address nor an IPvFuture). Latin-1 text never fails `_checknetloc`: no
/// latin-1 character's NFKC form holds `/?#@:`.
fn netloc(url: &[u8]) -> Option<Vec<u8>> {
    let start = url.iter().position(|&b| b > b' ').unwrap_or(url.len());
    let url: Vec<u8> = url[start..]
        .iter()
        .copied()
        .filter(|b| !matches!(b, b'\t' | b'\r' | b'\n'))
        .collect();
    let mut rest = url.as_slice();
    if let Some(colon) = rest.iter().position(|&b| b == b':') {
        let scheme_char = |b: &u8| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.');
        if colon > 0 && rest[0].is_ascii_alphabetic() && rest[..colon].iter().all(scheme_char) {
            rest = &rest[colon + 1..];
        }
    }
    let Some(after) = rest.strip_prefix(b"//") else {
        return Some(Vec::new());
    };
    let end = after
        .iter()
        .position(|b| matches!(b, b'/' | b'?' | b'#'))
        .unwrap_or(after.len());
    let netloc = &after[..end];
    let open = netloc.iter().position(|&b| b == b'[');
    let close = netloc.contains(&b']');
    match (open, close) {
        (None, false) => {}
        (Some(open), true) => {
            let inside = &netloc[open + 1..];
            let host = &inside[..inside
                .iter()
                .position(|&b| b == b']')
                .unwrap_or(inside.len())];
            if !bracketed_host(host) {
                return None;
            }
        }
        _ => return None,
    }
    Some(netloc.to_vec())
}

/// `_check_bracketed_host`: an IPvFuture (`v` hex digits `.` something) or an IPv6 address.
fn bracketed_host(host: &[u8]) -> bool {
    if let Some(future) = host.strip_prefix(b"v") {
        let hex = future.iter().take_while(|b| b.is_ascii_hexdigit()).count();
        return hex > 0 && future.get(hex) == Some(&b'.') && future.len() > hex + 1;
    }
    !is_v4(host) && is_v6(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OWN: [&str; 2] = ["localhost", "gw.internal"];

    fn foreign(host: Option<&str>, origin: Option<&str>) -> Option<String> {
        foreign_request(host.map(str::as_bytes), origin.map(str::as_bytes), |name| {
            OWN.contains(&name)
        })
    }

    #[allow(clippy::unnecessary_wraps)] // what `foreign_request` returns
    fn host_refused(name: &str) -> Option<String> {
        Some(format!(
            "Host {name} is not a name this gateway answers on: add it to \
             server.allowed_hosts, or configure API keys"
        ))
    }

    #[allow(clippy::unnecessary_wraps)] // what `foreign_request` returns
    fn origin_refused(shown: &str) -> Option<String> {
        Some(format!(
            "cross-origin request from {shown} refused by a gateway without API keys"
        ))
    }

    // IPv4 literals pass, with or without a port; leading zeros and 256 are no literal.
    #[test]
    fn ipv4_literals() {
        for host in ["127.0.0.1", "127.0.0.1:8000", "10.1.2.3:1", "0.0.0.0"] {
            assert_eq!(foreign(Some(host), None), None, "{host}");
        }
        assert_eq!(
            foreign(Some("127.0.0.01"), None),
            host_refused("'127.0.0.01'")
        );
        assert_eq!(
            foreign(Some("1.2.3.256"), None),
            host_refused("'1.2.3.256'")
        );
        assert_eq!(foreign(Some("1.2.3"), None), host_refused("'1.2.3'"));
    }

    // IPv6 literals, bare or bracketed with a port, scope ids and embedded IPv4 included.
    #[test]
    fn ipv6_literals() {
        let good = [
            "[::1]:8080",
            "[::1]",
            "[fe80::1%eth0]:80",
            "[::ffff:1.2.3.4]:1",
            "[1:2:3:4:5:6:7:8]",
            "[1::]",
            "[ABCD::EF]",
        ];
        for host in good {
            assert_eq!(foreign(Some(host), None), None, "{host}");
        }
        // Not bracketed, `::1` splits at its last colon as a name and port: `:` is refused.
        assert_eq!(foreign(Some("::1"), None), host_refused("':'"));
        for bad in [
            "[1:2:3:4:5:6:7:8:9]",
            "[1::2::3]",
            "[12345::]",
            "[:1:2::]",
            "[::1%]",
        ] {
            let name = &bad[1..bad.len() - 1];
            assert_eq!(
                foreign(Some(bad), None),
                host_refused(&format!("'{name}'")),
                "{bad}"
            );
        }
        // An unclosed bracket keeps the whole Host as its name.
        assert_eq!(foreign(Some("[::1"), None), host_refused("'[::1'"));
    }

    // Own names pass whatever their case and port; others are refused, lower-cased; an empty
    // port is no port; a superscript digit is one (`str.isdigit`).
    #[test]
    fn names_with_ports_and_case() {
        for host in ["localhost", "LOCALHOST:8000", "Gw.Internal:1", ""] {
            assert_eq!(foreign(Some(host), None), None, "{host}");
        }
        let own = |name: &str| OWN.contains(&name);
        assert_eq!(foreign_request(Some(b"gw.internal:\xb2"), None, own), None);
        assert_eq!(
            foreign(Some("Evil.COM:80"), None),
            host_refused("'evil.com'")
        );
        assert_eq!(
            foreign(Some("localhost:"), None),
            host_refused("'localhost:'")
        );
        assert_eq!(foreign(Some(":80"), None), host_refused("':80'"));
        // Latin-1 upper case lowers; the repr escapes what is not printable.
        assert_eq!(
            foreign_request(Some(b"\xc9vil\xa0'"), None, |_| false),
            host_refused("\"\u{e9}vil\\xa0'\"")
        );
    }

    // An Origin passes only when its netloc is the Host, without case; a path, query or
    // userinfo-free scheme changes nothing; the shown Origin is the raw header.
    #[test]
    fn origins() {
        let host = Some("localhost:8000");
        for origin in [
            "http://localhost:8000",
            "https://LOCALHOST:8000/path?q#f",
            " http://localhost:8000 ",
            "//localhost:8000",
            "ht\ttp://local\nhost:8000",
        ] {
            assert_eq!(foreign(host, Some(origin)), None, "{origin}");
        }
        let refused = [
            ("http://localhost", "'http://localhost'"),
            ("http://evil.com", "'http://evil.com'"),
            ("null", "'null'"),
            ("localhost:8000", "'localhost:8000'"),
            ("", "''"),
        ];
        for (origin, shown) in refused {
            assert_eq!(
                foreign(host, Some(origin)),
                origin_refused(shown),
                "{origin}"
            );
        }
        let v6 = Some("[::1]:8000");
        assert_eq!(foreign(v6, Some("http://[::1]:8000")), None);
        // What `urlsplit` raises on is refused, not answered with a 500.
        assert_eq!(
            foreign(Some("[1.2.3.4]"), Some("http://[1.2.3.4]")),
            origin_refused("'http://[1.2.3.4]'")
        );
        let unclosed = foreign(Some("localhost"), Some("http://[localhost"));
        assert_eq!(unclosed, origin_refused("'http://[localhost'"));
        // An IPvFuture in brackets is a host `urlsplit` takes, when well formed.
        let future =
            |origin: &[u8]| foreign_request(Some(b"[v1.x]"), Some(origin), |n| n == "v1.x");
        assert_eq!(future(b"http://[v1.x]"), None);
        assert_eq!(future(b"http://[v.x]"), origin_refused("'http://[v.x]'"));
    }

    // An Origin with no Host is refused (no netloc equals an absent Host); so is one with a
    // Host that is not the gateway's, for the Host; the shown Origin is cut at 100 bytes.
    #[test]
    fn origin_without_host() {
        assert_eq!(
            foreign(None, Some("http://localhost")),
            origin_refused("'http://localhost'")
        );
        assert_eq!(foreign(None, None), None);
        let long = format!("http://{}", "a".repeat(200));
        let shown = format!("'{}'", &long[..100]);
        assert_eq!(
            foreign(Some("localhost"), Some(&long)),
            origin_refused(&shown)
        );
    }
}
