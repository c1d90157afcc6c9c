//! `KeyRing.authenticate` (`gateway/auth.py`): an `Authorization: Bearer KEY` header to the
//! tenant and tier the config gives that key.
//!
//! The same parse and the same digests as Python's, so a key opens the same tenant on both
//! paths: the header's bytes are read as latin-1 (as every ASGI server gives them), the
//! scheme matched without case, the key stripped as `str.strip` strips it, its length bounded
//! before it is hashed, then its SHA-256 compared with every configured key's, all of them
//! every time and each in constant time: how long a lookup takes says neither how much of a
//! guess matched nor which key did. On any failure there is no identity, and the 401's
//! message is Python's (`_presented`, `authenticate`), which the front answers with.

use sha2::{Digest as _, Sha256};

/// Who a request is from, as the config says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub tenant: String,
    pub tier: String,
}

/// The configured API keys, by their digests.
#[derive(Debug, Clone)]
pub struct KeyRing {
    enabled: bool,
    anonymous: Identity,
    max_bytes: usize,
    keys: Vec<([u8; 32], Identity)>,
}

impl KeyRing {
    /// `keys`: each key's UTF-8 bytes (Python's `key.encode("utf-8", "surrogatepass")`) and
    /// whose it is; `enabled`: `settings.auth_enabled` (else every caller is `anonymous`);
    /// `max_bytes`: `limits.max_api_key_bytes`.
    pub fn new(
        enabled: bool,
        anonymous: Identity,
        max_bytes: usize,
        keys: Vec<(Vec<u8>, Identity)>,
    ) -> Self {
        let keys = keys
            .into_iter()
            .map(|(key, who)| (digest(&key), who))
            .collect();
        KeyRing {
            enabled,
            anonymous,
            max_bytes,
            keys,
        }
    }

    /// The identity of a request's `Authorization` header (the raw bytes of the first one, as
    /// Starlette reads it; `None` when absent), or `None` where Python answers 401 (missing,
    /// not Bearer, too long, unknown).
    pub fn authenticate(&self, authorization: Option<&[u8]>) -> Option<&Identity> {
        self.check(authorization).ok()
    }

    /// The identity of a request's `Authorization` header, or the message of the 401 that
    /// Python answers (`GatewayError(401, message, "invalid_api_key")`).
    pub fn check(&self, authorization: Option<&[u8]>) -> Result<&Identity, String> {
        if !self.enabled {
            return Ok(&self.anonymous);
        }
        let presented = self.presented(authorization.unwrap_or_default())?;
        let mut found = None;
        for (known, who) in &self.keys {
            // No early exit: every key is compared every time; the last match wins, as in
            // Python's loop.
            if equal(known, &presented) {
                found = Some(who);
            }
        }
        found.ok_or_else(|| "invalid API key".to_owned())
    }

    fn presented(&self, header: &[u8]) -> Result<[u8; 32], String> {
        const BEARER: &[u8] = b"bearer ";
        // Latin-1 has no character outside ASCII whose lower case is ASCII: ASCII case
        // folding is `str.lower()` here. An empty header is a missing one (`not authorization`).
        if header.len() < BEARER.len() || !header[..BEARER.len()].eq_ignore_ascii_case(BEARER) {
            return Err("missing API key: send 'Authorization: Bearer KEY'".to_owned());
        }
        let key = super::pytext::strip_latin1(&header[BEARER.len()..]);
        if key.len() > self.max_bytes {
            // Checked before hashing: a megabyte key costs nothing. A latin-1 character is
            // one byte: Python's `len` of the text is this length.
            return Err(format!(
                "API key is longer than {} bytes, so it cannot be valid: check what is sent in \
                 'Authorization: Bearer KEY'",
                self.max_bytes
            ));
        }
        // The latin-1 text encoded as UTF-8, as Python hashes `key.encode("utf-8")`.
        let text: String = key.iter().map(|&b| char::from(b)).collect();
        Ok(digest(text.as_bytes()))
    }
}

fn digest(key: &[u8]) -> [u8; 32] {
    Sha256::digest(key).into()
}

/// `hmac.compare_digest` for two digests: the time does not depend on where they differ.
fn equal(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn who(tenant: &str) -> Identity {
        Identity {
            tenant: tenant.to_owned(),
            tier: "gold".to_owned(),
        }
    }

    fn ring() -> KeyRing {
        let keys = vec![
            (b"sk-alpha-000000".to_vec(), who("a")),
            ("clé-0000000000".as_bytes().to_vec(), who("b")),
        ];
        KeyRing::new(true, who("anonymous"), 20, keys)
    }

    // Any case of the scheme, whitespace around the key; the tenant of the key.
    #[test]
    fn bearer_keys() {
        let ring = ring();
        for header in [
            &b"Bearer sk-alpha-000000"[..],
            b"bEaReR   sk-alpha-000000 \t",
            b"BEARER sk-alpha-000000\xa0",
        ] {
            assert_eq!(ring.authenticate(Some(header)), Some(&who("a")));
        }
        // A non-ASCII key: its latin-1 bytes are the text Python hashes as UTF-8.
        assert_eq!(
            ring.authenticate(Some(b"Bearer cl\xe9-0000000000")),
            Some(&who("b"))
        );
        assert_eq!(
            ring.authenticate(Some("Bearer clé-0000000000".as_bytes())),
            None
        );
    }

    // Missing, another scheme, no space, too long, unknown: no identity.
    #[test]
    fn refusals() {
        let ring = ring();
        assert_eq!(ring.authenticate(None), None);
        for header in [
            &b""[..],
            b"Basic sk-alpha-000000",
            b"Bearersk-alpha-000000",
            b"Bearer",
            b"Bearer ",
            b"Bearer sk-alpha-000001",
            b"Bearer sk-alpha-000000-and-more-bytes",
        ] {
            assert_eq!(ring.authenticate(Some(header)), None, "{header:?}");
        }
    }

    // Each refusal with the message Python's 401 says.
    #[test]
    fn refusal_messages() {
        let ring = ring();
        let missing = "missing API key: send 'Authorization: Bearer KEY'";
        for header in [None, Some(&b""[..]), Some(b"Basic x"), Some(b"Bearer")] {
            assert_eq!(ring.check(header), Err(missing.to_owned()), "{header:?}");
        }
        let long = "API key is longer than 20 bytes, so it cannot be valid: check what is sent \
                    in 'Authorization: Bearer KEY'";
        assert_eq!(ring.check(Some(&[b'k'; 28])), Err(missing.to_owned()));
        let mut header = b"Bearer ".to_vec();
        header.extend_from_slice(&[b'k'; 21]);
        assert_eq!(ring.check(Some(&header)), Err(long.to_owned()));
        header.pop();
        assert_eq!(ring.check(Some(&header)), Err("invalid API key".to_owned()));
    }

    // With auth off every caller is the anonymous tenant, whatever it sends.
    #[test]
    fn anonymous_when_off() {
        let ring = KeyRing::new(false, who("anonymous"), 20, vec![]);
        assert_eq!(ring.authenticate(None), Some(&who("anonymous")));
        assert_eq!(
            ring.authenticate(Some(b"Bearer x")),
            Some(&who("anonymous"))
        );
    }

    // Two tenants under one key: the last configured wins, as Python's loop leaves it.
    #[test]
    fn last_match_wins() {
        let keys = vec![
            (b"k".to_vec(), who("first")),
            (b"k".to_vec(), who("second")),
        ];
        let ring = KeyRing::new(true, who("anonymous"), 20, keys);
        assert_eq!(ring.authenticate(Some(b"Bearer k")), Some(&who("second")));
    }
}
