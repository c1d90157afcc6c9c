//! Connections to vLLM that the stream owns while it uses them.
//!
//! A stream polls its connection's driver inside its own task, so closing the connection
//! (an abort, a client gone) is a `close` on the socket in that same step: vLLM sees the
//! disconnect before the host hears of it and before the runtime can start anything in the
//! freed slot. (A pool whose connections run as tasks of their own, as hyper-util's client
//! does, closes them a wake-up later, and a new request can reach vLLM first: the cap, as vLLM
//! counts it, would be passed for a moment.) Connections that finished a reply cleanly wait
//! here for the next request to the same backend.
//!
//! A backend served over https gets TLS on the same socket (rustls: SNI, the certificate
//! checked against the host name, ALPN `http/1.1`), verified against the roots the Python
//! path trusts: the Mozilla set (certifi's, `webpki-roots` here), or the backend's own
//! `tls_ca_file` alone; where the backend asks for a client certificate (mutual TLS), the one
//! its `tls_client_cert` names. Its connections are pooled as plain ones are, by origin.

use std::future::Future;
use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::client::conn::http1::{self, Connection, SendRequest};
use hyper_util::rt::TokioIo;
use rustc_hash::FxHashMap;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

/// The driver of one HTTP/1.1 connection (reads and writes the socket when polled).
pub type Driver = Pin<Box<Connection<TokioIo<Io>, Full<Bytes>>>>;

/// How an https backend is spoken to: the roots its certificate must chain to, and the
/// certificate the gateway shows it where the backend asks for one (mutual TLS).
#[derive(Clone, Debug)]
pub struct Tls {
    config: Arc<ClientConfig>,
}

/// A client certificate chain and its private key, as the gateway shows them to a backend
/// that asks (its `tls_client_cert` and `tls_client_key`).
pub struct ClientIdentity {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl ClientIdentity {
    /// The certificate chain of `cert_file` (the gateway's own certificate first) and the
    /// private key of `key_file`, or of `cert_file` where None (one PEM holding both), as
    /// `ssl.SSLContext.load_cert_chain(cert_file, key_file)` reads them.
    ///
    /// # Errors
    /// A file cannot be read, a PEM section is broken, or it holds no certificate or no key.
    pub fn from_files(cert_file: &Path, key_file: Option<&Path>) -> Result<Self, String> {
        let shown = cert_file.display();
        let chain = CertificateDer::pem_file_iter(cert_file)
            .and_then(Iterator::collect::<Result<Vec<_>, _>>)
            .map_err(|e| format!("tls_client_cert {shown}: cannot be read as PEM: {e}"))?;
        if chain.is_empty() {
            return Err(format!("tls_client_cert {shown}: holds no PEM certificate"));
        }
        let (field, path) = match key_file {
            Some(path) => ("tls_client_key", path),
            None => ("tls_client_cert", cert_file),
        };
        let key = PrivateKeyDer::from_pem_file(path).map_err(|e| match e {
            pem::Error::NoItemsFound => {
                format!("{field} {}: holds no PEM private key", path.display())
            }
            e => format!("{field} {}: cannot be read as PEM: {e}", path.display()),
        })?;
        Ok(Self { chain, key })
    }
}

impl Tls {
    /// The Mozilla roots (`webpki-roots`, the set certifi ships to the Python path).
    pub fn mozilla() -> Tls {
        static MOZILLA: OnceLock<Tls> = OnceLock::new();
        MOZILLA
            .get_or_init(|| Tls::build(mozilla_roots(), None).expect("no client identity"))
            .clone()
    }

    /// The certificates of a PEM bundle as the only roots (a backend's `tls_ca_file`, as
    /// `ssl.create_default_context(cafile=...)` trusts it).
    ///
    /// # Errors
    /// The file cannot be read, a PEM section is broken, it holds no certificate, or one is
    /// not a CA certificate rustls can use.
    pub fn from_ca_file(path: &Path) -> Result<Tls, String> {
        Tls::build(roots_of(path)?, None)
    }

    /// A backend's TLS as its config says: its own roots (`ca_file`) or the Mozilla set, and
    /// the certificate shown when it asks for one (`client`); None where neither is given
    /// (the relay then uses [`Tls::mozilla`]).
    ///
    /// # Errors
    /// As [`Tls::from_ca_file`]; or the client key does not match its certificate, or is of a
    /// kind rustls cannot sign with.
    pub fn for_backend(
        ca_file: Option<&Path>,
        client: Option<ClientIdentity>,
    ) -> Result<Option<Tls>, String> {
        if ca_file.is_none() && client.is_none() {
            return Ok(None);
        }
        let roots = match ca_file {
            Some(path) => roots_of(path)?,
            None => mozilla_roots(),
        };
        Tls::build(roots, client).map(Some)
    }

    fn build(roots: RootCertStore, client: Option<ClientIdentity>) -> Result<Tls, String> {
        // ring, named rather than the process default: it builds without cmake (aws-lc-rs,
        // whose post-quantum key exchange is why rustls deprecates this, does not).
        #[allow(deprecated)]
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("ring supports the default protocol versions")
            .with_root_certificates(roots);
        let mut config = match client {
            None => builder.with_no_client_auth(),
            Some(identity) => builder
                .with_client_auth_cert(identity.chain, identity.key)
                .map_err(|e| {
                    format!("tls_client_key: not the key of tls_client_cert, or unusable: {e}")
                })?,
        };
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Tls {
            config: Arc::new(config),
        })
    }
}

fn mozilla_roots() -> RootCertStore {
    RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    }
}

fn roots_of(path: &Path) -> Result<RootCertStore, String> {
    let shown = path.display();
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(Iterator::collect::<Result<Vec<_>, _>>)
        .map_err(|e| format!("tls_ca_file {shown}: cannot be read as PEM: {e}"))?;
    if certs.is_empty() {
        return Err(format!("tls_ca_file {shown}: holds no PEM certificate"));
    }
    let mut roots = RootCertStore::empty();
    for cert in certs {
        roots
            .add(cert)
            .map_err(|e| format!("tls_ca_file {shown}: a certificate is unusable: {e}"))?;
    }
    Ok(roots)
}

/// Where a stream's connections go: the backend's `host:port` and, over https, its TLS.
#[derive(Clone)]
pub struct Origin {
    /// `host:port`: where the socket connects, and the request's Host.
    pub authority: String,
    tls: Option<(Tls, ServerName<'static>)>,
    /// The pool's key: the scheme and the authority.
    key: String,
}

impl Origin {
    /// `host` as a URL writes it (an IPv6 literal in brackets), `port`, and TLS or not.
    ///
    /// # Errors
    /// Over TLS, `host` is neither a DNS name nor an IP address a certificate can name.
    pub fn new(host: &str, port: u16, tls: Option<Tls>) -> Result<Origin, String> {
        let authority = format!("{host}:{port}");
        let tls = match tls {
            None => None,
            Some(tls) => {
                let bare = host.trim_start_matches('[').trim_end_matches(']');
                let name = ServerName::try_from(bare.to_owned()).map_err(|e| {
                    format!("{host:?} cannot be checked against a certificate: {e}")
                })?;
                Some((tls, name))
            }
        };
        let scheme = if tls.is_some() { "https" } else { "http" };
        Ok(Origin {
            key: format!("{scheme}://{authority}"),
            authority,
            tls,
        })
    }
}

/// A connection's socket: plain TCP, or TLS over it.
pub enum Io {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl AsyncRead for Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Io {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// One connection to a backend: where to send requests, and its driver.
pub struct Conn {
    pub sender: SendRequest<Full<Bytes>>,
    pub driver: Driver,
    /// It served a request before (a failure before any reply may be its staleness).
    pub reused: bool,
}

/// Idle connections longer than this are dropped rather than reused: uvicorn (vLLM's server)
/// closes keep-alive connections after 5 s, and a request must not race that close.
const IDLE_FOR_AT_MOST: Duration = Duration::from_secs(4);
const IDLE_PER_BACKEND: usize = 1024;

struct Idle {
    conn: Conn,
    since: Instant,
}

/// Idle connections per backend origin (`http://host:port` or `https://host:port`).
#[derive(Default)]
pub struct Pool {
    idle: Mutex<FxHashMap<String, Vec<Idle>>>,
}

impl Pool {
    /// An idle connection to `origin` that is still open, or a new one.
    ///
    /// # Errors
    /// The backend cannot be reached within `timeout`.
    pub async fn checkout(&self, origin: &Origin, timeout: Duration) -> io::Result<Conn> {
        while let Some(idle) = self.pop(&origin.key) {
            let mut conn = idle.conn;
            if idle.since.elapsed() > IDLE_FOR_AT_MOST || conn.sender.is_closed() {
                continue;
            }
            // One poll of the driver: a connection the backend closed meanwhile ends now.
            let mut cx = Context::from_waker(Waker::noop());
            if conn.driver.as_mut().poll(&mut cx).is_ready() {
                continue;
            }
            conn.reused = true;
            return Ok(conn);
        }
        Self::connect(origin, timeout).await
    }

    /// A new connection to `origin`.
    ///
    /// # Errors
    /// The backend cannot be reached within `timeout` (the TLS handshake included, as
    /// Python's `open_connection` counts it), or its certificate is not trusted (the
    /// `rustls::Error` inside the `io::Error`).
    pub async fn connect(origin: &Origin, timeout: Duration) -> io::Result<Conn> {
        let io = tokio::time::timeout(timeout, open(origin))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))??;
        let (sender, driver) = http1::handshake(TokioIo::new(io))
            .await
            .map_err(io::Error::other)?;
        Ok(Conn {
            sender,
            driver: Box::pin(driver),
            reused: false,
        })
    }

    /// Keep a connection whose last reply ended cleanly.
    pub fn checkin(&self, origin: &Origin, conn: Conn) {
        let mut idle = self.idle.lock().unwrap();
        let list = idle.entry(origin.key.clone()).or_default();
        if list.len() < IDLE_PER_BACKEND {
            list.push(Idle {
                conn,
                since: Instant::now(),
            });
        }
    }

    /// Close every idle connection (the relay is shutting down): a backend over TLS would
    /// otherwise wait, on each, for a close_notify that a connection nobody polls never sends.
    pub fn close_idle(&self) {
        self.idle.lock().unwrap().clear();
    }

    fn pop(&self, key: &str) -> Option<Idle> {
        self.idle.lock().unwrap().get_mut(key)?.pop()
    }
}

/// The socket to `origin`, its TLS handshake done over https.
async fn open(origin: &Origin) -> io::Result<Io> {
    let stream = TcpStream::connect(&origin.authority).await?;
    stream.set_nodelay(true)?;
    let Some((tls, name)) = &origin.tls else {
        return Ok(Io::Plain(stream));
    };
    let stream = TlsConnector::from(Arc::clone(&tls.config))
        .connect(name.clone(), stream)
        .await?;
    Ok(Io::Tls(Box::new(stream)))
}

#[cfg(test)]
mod tests {
    use super::*;

    // http and https connections to one host and port are pooled apart.
    #[test]
    fn the_pool_keeps_plain_and_tls_connections_apart() {
        let plain = Origin::new("vllm", 8000, None).unwrap();
        let tls = Origin::new("vllm", 8000, Some(Tls::mozilla())).unwrap();
        assert_eq!(
            (plain.key.as_str(), plain.tls.is_some()),
            ("http://vllm:8000", false)
        );
        assert_eq!(
            (tls.key.as_str(), tls.tls.is_some()),
            ("https://vllm:8000", true)
        );
        assert_eq!(plain.authority, tls.authority);
    }

    // An IPv6 literal connects with its brackets and is checked by its address.
    #[test]
    fn an_ipv6_literal_is_an_address_to_check() {
        let origin = Origin::new("[::1]", 8443, Some(Tls::mozilla())).unwrap();
        assert_eq!(origin.authority, "[::1]:8443");
        let (_, name) = origin.tls.as_ref().unwrap();
        assert!(matches!(name, ServerName::IpAddress(_)));
    }

    // A host no certificate can name is refused when the stream is opened, not at connect.
    #[test]
    fn a_host_no_certificate_can_name_is_refused() {
        let refused = Origin::new("bad_host!", 443, Some(Tls::mozilla())).err();
        assert!(refused.is_some_and(|e| e.contains("cannot be checked against a certificate")));
        assert!(Origin::new("bad_host!", 80, None).is_ok()); // plain http checks no name
    }
}
