//! A stream against a real socket pair and a backend on loopback: what a client reads.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use super::{Control, Relay, RelayConfig, RelayEvent, StreamRequest};

const HEAD: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
    transfer-encoding: chunked\r\n\r\n";

fn config() -> RelayConfig {
    RelayConfig {
        threads: 1,
        client_window: 64,
        pause_when_full: true,
        flush_interval: Duration::ZERO,
        token_flush: Duration::from_millis(20),
        connect_timeout: Duration::from_secs(5),
        max_event_bytes: 1 << 20,
    }
}

fn chunk(text: &str, finish: Option<&str>) -> String {
    let finish = finish.map_or("null".to_owned(), |f| format!("\"{f}\""));
    format!(
        "data: {{\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\",\
         \"choices\":[{{\"index\":0,\"text\":\"{text}\",\"logprobs\":null,\
         \"finish_reason\":{finish},\"stop_reason\":null}}],\"usage\":null}}\n\n"
    )
}

/// A backend that answers one streamed completion whole, at once: two tokens and `[DONE]`.
fn backend() -> String {
    backend_sending(vec![
        chunk("a", None),
        chunk("b", Some("length")),
        "data: [DONE]\n\n".into(),
    ])
}

/// A backend that answers one streamed request whole, at once, with `events`.
fn backend_sending(events: Vec<String>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/v1/completions", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        let (mut socket, _) = listener.accept().unwrap();
        let mut request = Vec::new();
        let mut buf = [0u8; 4096];
        while !request.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = socket.read(&mut buf).unwrap();
            request.extend_from_slice(&buf[..n]);
        }
        let mut reply = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
            transfer-encoding: chunked\r\n\r\n"
            .to_vec();
        for event in events {
            reply.extend_from_slice(format!("{:x}\r\n{event}\r\n", event.len()).as_bytes());
        }
        reply.extend_from_slice(b"0\r\n\r\n");
        socket.write_all(&reply).unwrap();
        std::thread::sleep(Duration::from_secs(2)); // the relay may pool the connection
    });
    url
}

/// A streamed completion `id` to `url`, sent upstream as `request_id`, its events to `sink`;
/// a test changes what its case needs (`StreamRequest { kind, ..stream_request(...) }`).
fn stream_request<'a>(
    id: u64,
    url: &'a str,
    request_id: &'a str,
    sink: super::Sink,
) -> StreamRequest<'a> {
    StreamRequest {
        id,
        url,
        tls: None,
        body: b"{\"model\":\"m\",\"prompt\":\"x\",\"stream\":true}".to_vec(),
        request_id,
        traceparent: None,
        include_usage: false,
        continuous_usage: false,
        choices: 1,
        unstreamed: false,
        whole: false,
        kind: crate::relay::ReplyKind::Chunks,
        sink,
    }
}

/// Lend stream `id` a client's socket (`Control::Hold`, the reply's head held for its first
/// token) and read what that client gets, to the chunked body's end; the client is kept
/// open, so its socket can come back.
fn lend_and_read(relay: &Relay, id: u64) -> (TcpStream, Vec<u8>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (lent, _) = listener.accept().unwrap();
    let hold = Control::Hold {
        socket: lent,
        head: HEAD.to_vec(),
        keep_alive: true,
    };
    assert!(relay.control(id, hold));
    client
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut read = Vec::new();
    let mut buf = [0u8; 4096];
    while !read.ends_with(b"0\r\n\r\n") {
        match client.read(&mut buf) {
            Ok(n) if n > 0 => read.extend_from_slice(&buf[..n]),
            other => panic!(
                "the client read {other:?} after {:?}",
                String::from_utf8_lossy(&read)
            ),
        }
    }
    (client, read)
}

/// Close the socket a clean end handed back (`Closed`'s).
fn close_handed_back(socket: Option<i32>) {
    let fd = socket.expect("a clean end hands the socket back");
    // SAFETY: the relay handed this socket over; it is closed here.
    drop(unsafe { <TcpStream as std::os::fd::FromRawFd>::from_raw_fd(fd) });
}

// The stream's task can read vLLM's first token before the request's task lends it the
// client's socket (they run on different threads): the head, held for the first token, must
// still go out first, with every chunk after it, and the socket come back after the end.
#[test]
fn a_socket_lent_after_the_first_token_gets_the_whole_reply() {
    let relay = Relay::new(config()).unwrap();
    let (sink, mut events) = tokio::sync::mpsc::unbounded_channel();
    let url = backend();
    relay
        .open(stream_request(7, &url, "llmflow-7", sink))
        .unwrap();
    loop {
        match events.blocking_recv() {
            Some(RelayEvent::FirstToken { .. }) => break,
            Some(_) => {}
            None => panic!("the stream ended before its first token"),
        }
    }
    let (_client, read) = lend_and_read(&relay, 7);
    let text = String::from_utf8_lossy(&read);
    assert!(read.starts_with(HEAD), "{text}");
    assert!(
        text.contains("\"text\":\"a\"") && text.contains("\"text\":\"b\""),
        "{text}"
    );
    assert!(text.contains("data: [DONE]"), "{text}");
    loop {
        match events.blocking_recv() {
            Some(RelayEvent::Closed { socket, .. }) => {
                close_handed_back(socket);
                break;
            }
            Some(_) => {}
            None => panic!("no Closed event"),
        }
    }
}

// A Responses stream: each event goes out as vLLM framed it, the reply ends with the body
// (no `[DONE]`), its tokens are the deltas settled by the final usage, and the socket comes
// back for the client's next request.
#[test]
fn a_responses_stream_ends_with_its_body_and_counts_its_deltas() {
    let relay = Relay::new(config()).unwrap();
    let (sink, mut events) = tokio::sync::mpsc::unbounded_channel();
    let delta = |t: &str| {
        format!("event: response.output_text.delta\ndata: {{\"type\":\"response.output_text.delta\",\"delta\":\"{t}\"}}\n\n")
    };
    let completed = "event: response.completed\ndata: {\"type\":\"response.completed\",\
        \"response\":{\"usage\":{\"output_tokens\":3}}}\n\n";
    let url = backend_sending(vec![delta("a"), delta("b"), completed.to_owned()]);
    let request = StreamRequest {
        body: b"{\"model\":\"m\",\"input\":\"x\",\"stream\":true}".to_vec(),
        kind: crate::relay::ReplyKind::Events,
        ..stream_request(9, &url, "llmflow-9", sink)
    };
    relay.open(request).unwrap();
    let (_client, read) = lend_and_read(&relay, 9);
    let mut expected = HEAD.to_vec();
    for frame in [delta("a"), delta("b"), completed.to_owned()] {
        expected.extend_from_slice(format!("{:x}\r\n{frame}\r\n", frame.len()).as_bytes());
    }
    expected.extend_from_slice(b"0\r\n\r\n");
    assert_eq!(
        String::from_utf8_lossy(&read),
        String::from_utf8_lossy(&expected)
    );
    let (mut tokens, mut done) = (0, false);
    loop {
        match events.blocking_recv() {
            Some(RelayEvent::FirstToken { n, .. } | RelayEvent::Tokens(_, n)) => {
                tokens += u64::from(n);
            }
            Some(RelayEvent::Done(_)) => done = true,
            Some(RelayEvent::Closed {
                socket,
                upstream_complete,
                completion_tokens,
                ..
            }) => {
                assert!(done && upstream_complete);
                assert_eq!((tokens, completion_tokens), (3, 3));
                close_handed_back(socket);
                break;
            }
            Some(RelayEvent::Failed(_, failure)) => panic!("{failure:?}"),
            Some(_) => {}
            None => panic!("no Closed event"),
        }
    }
}

/// A backend that answers each request on one kept-alive connection with `answer` (JSON, not
/// streamed), and hands each request's head to `heads`.
fn json_backend(
    answer: &'static str,
    replies: usize,
) -> (String, std::sync::mpsc::Receiver<String>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/v1/completions", listener.local_addr().unwrap());
    let (heads, seen) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (mut socket, _) = listener.accept().unwrap();
        for _ in 0..replies {
            let mut request = Vec::new();
            let mut buf = [0u8; 4096];
            while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = socket.read(&mut buf).unwrap();
                assert!(n > 0, "the relay closed the connection");
                request.extend_from_slice(&buf[..n]);
            }
            let _ = heads.send(String::from_utf8_lossy(&request).into_owned());
            let reply = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{answer}",
                answer.len()
            );
            socket.write_all(reply.as_bytes()).unwrap();
        }
        std::thread::sleep(Duration::from_secs(2));
    });
    (url, seen)
}

// P/D's prefill hop: its answer comes whole to the host, whatever JSON it is (an array here:
// `prefill_hop` reads it as an answer without parameters, not as a failure), with no
// `Started` and no tokens; its connection goes back to the pool for the next request.
#[test]
fn a_hop_hands_its_answer_over_as_it_came_and_keeps_its_connection() {
    let relay = Relay::new(config()).unwrap();
    let answer = r#"[{"usage":{"completion_tokens":1}}]"#;
    let (url, heads) = json_backend(answer, 2);
    for id in [1, 2] {
        let (sink, mut events) = tokio::sync::mpsc::unbounded_channel();
        let request_id = format!("llmflow-{id}");
        let hop = super::HopRequest {
            id,
            url: &url,
            tls: None,
            body: b"{\"model\": \"m\"}".to_vec(),
            request_id: &request_id,
            sink,
        };
        relay.streams().hop(hop).unwrap();
        let mut seen = Vec::new();
        while let Some(event) = events.blocking_recv() {
            let closed = matches!(event, RelayEvent::Closed { .. });
            seen.push(event);
            if closed {
                break;
            }
        }
        assert_eq!(
            seen,
            [
                RelayEvent::Answer(id, answer.as_bytes().to_vec()),
                RelayEvent::Closed {
                    id,
                    socket: None,
                    upstream_complete: true,
                    completion_tokens: 0,
                    truncated: false,
                }
            ]
        );
        let head = heads.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(
            head.contains(&format!("x-request-id: {request_id}\r\n")),
            "{head}"
        );
        assert!(head.contains("accept: application/json\r\n"), "{head}");
        assert!(!head.contains("traceparent"), "{head}");
    }
    assert_eq!(relay.live(), 0);
}

// ---- backends over https ------------------------------------------------------------------

mod tls {
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::sync::Arc;
    use std::time::Duration;

    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

    use super::super::upstream::{ClientIdentity, Tls};
    use super::super::{Control, Failure, Relay, RelayEvent, StreamRequest};
    use super::{chunk, config, stream_request};

    /// A throwaway CA (its PEM) and a server certificate it issued for `names`, with its key.
    struct Pki {
        ca_pem: String,
        cert: CertificateDer<'static>,
        key: PrivateKeyDer<'static>,
    }

    fn pki(names: &[&str]) -> Pki {
        let mut params = CertificateParams::new(Vec::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let key = KeyPair::generate().unwrap();
        let names: Vec<String> = names.iter().map(|&n| n.to_owned()).collect();
        let cert = CertificateParams::new(names)
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        Pki {
            ca_pem: ca.pem(),
            cert: cert.der().clone(),
            key: PrivatePkcs8KeyDer::from(key.serialize_der()).into(),
        }
    }

    fn ca_file(pem: &str) -> (tempdir::Dir, std::path::PathBuf) {
        let dir = tempdir::Dir::new();
        let path = dir.0.join("ca.pem");
        std::fs::write(&path, pem).unwrap();
        (dir, path)
    }

    /// An https backend on loopback that takes ONE connection and answers `replies` streamed
    /// completions on it, one after another.
    struct Backend {
        port: u16,
        /// The name the client asked for by SNI, once per request answered.
        sni: std::sync::mpsc::Receiver<String>,
        /// Said when the client closed the connection after the last reply.
        closed: std::sync::mpsc::Receiver<()>,
    }

    fn https_backend(pki: &Pki, replies: usize) -> Backend {
        https_backend_asking(pki, replies, None)
    }

    /// As [`https_backend`]; with `clients`, a client must show a certificate that chains to
    /// this CA (PEM) (mutual TLS).
    fn https_backend_asking(pki: &Pki, replies: usize, clients: Option<&str>) -> Backend {
        #[allow(deprecated)] // ring: see `Tls::build`
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .unwrap();
        let builder = match clients {
            None => builder.with_no_client_auth(),
            Some(pem) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
                    roots.add(cert.unwrap()).unwrap();
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .build()
                .unwrap();
                builder.with_client_cert_verifier(verifier)
            }
        };
        let config = builder
            .with_single_cert(vec![pki.cert.clone()], pki.key.clone_key())
            .unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let (names, sni) = std::sync::mpsc::channel();
        let (gone, closed) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let (socket, _) = listener.accept().unwrap();
            socket
                .set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            let conn = rustls::ServerConnection::new(Arc::new(config)).unwrap();
            let mut tls = rustls::StreamOwned::new(conn, socket);
            for _ in 0..replies {
                if read_request(&mut tls).is_none() {
                    // The handshake failed (its alert sent) or the client went: read to the
                    // client's close, so that this side's close sends no reset ahead of it.
                    let _ = tls.sock.shutdown(std::net::Shutdown::Write);
                    let mut rest = [0u8; 4096];
                    while matches!(tls.sock.read(&mut rest), Ok(n) if n > 0) {}
                    return;
                }
                let _ = names.send(tls.conn.server_name().unwrap_or("").to_owned());
                let mut reply = super::HEAD.to_vec();
                for event in [chunk("a", None), chunk("b", Some("length"))] {
                    reply.extend_from_slice(format!("{:x}\r\n{event}\r\n", event.len()).as_bytes());
                }
                reply.extend_from_slice(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n");
                tls.write_all(&reply).unwrap();
            }
            let mut buf = [0u8; 1];
            match tls.read(&mut buf) {
                Ok(0) => {}
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {}
                other => panic!("the client kept the connection: {other:?}"),
            }
            let _ = gone.send(());
        });
        Backend { port, sni, closed }
    }

    /// One request's head and body (by its content-length); None when the peer is gone.
    fn read_request(tls: &mut impl Read) -> Option<Vec<u8>> {
        let mut request = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            if let Some(end) = request.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&request[..end]).to_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |v| v.trim().parse().unwrap());
                if request.len() >= end + 4 + length {
                    return Some(request);
                }
            }
            match tls.read(&mut buf) {
                Ok(n) if n > 0 => request.extend_from_slice(&buf[..n]),
                _ => return None,
            }
        }
    }

    /// Relay one completion to `url`, assembled whole; its payloads, or its failure.
    fn relay_one(relay: &Relay, id: u64, url: &str, ca: Option<&Tls>) -> Result<usize, Failure> {
        let (sink, mut events) = tokio::sync::mpsc::unbounded_channel();
        let request = StreamRequest {
            tls: ca,
            whole: true,
            ..stream_request(id, url, "llmflow-1", sink)
        };
        relay.open(request).unwrap();
        let mut payloads = 0;
        let mut failure = None;
        loop {
            match events.blocking_recv() {
                Some(RelayEvent::Payload(..)) => payloads += 1,
                Some(RelayEvent::Failed(_, f)) => {
                    failure = Some(f);
                    relay.control(id, Control::Close);
                }
                Some(RelayEvent::Closed { .. }) => break,
                Some(_) => {}
                None => panic!("no Closed event"),
            }
        }
        failure.map_or(Ok(payloads), Err)
    }

    // A backend whose certificate chains to its CA file is served, with SNI, and its
    // connection is kept for the next request (the backend accepts only one).
    #[test]
    fn an_https_backend_is_relayed_over_one_pooled_connection() {
        let pki = pki(&["localhost"]);
        let (_dir, path) = ca_file(&pki.ca_pem);
        let ca = Tls::from_ca_file(&path).unwrap();
        let backend = https_backend(&pki, 2);
        let mut relay = Relay::new(config()).unwrap();
        let url = format!("https://localhost:{}/v1/completions", backend.port);
        assert_eq!(relay_one(&relay, 1, &url, Some(&ca)), Ok(2));
        assert_eq!(relay_one(&relay, 2, &url, Some(&ca)), Ok(2));
        let names: Vec<String> = backend.sni.try_iter().collect();
        assert_eq!(names, ["localhost", "localhost"]);
        // Shut down, the relay closes the connection it kept (a TLS peer would wait on it).
        assert!(backend.closed.try_recv().is_err());
        relay.shutdown();
        backend.closed.recv().unwrap();
    }

    // Without its CA file the backend's private CA is not among the Mozilla roots: the
    // connect fails as Python's does, and the backend is marked down.
    #[test]
    fn a_certificate_of_an_unknown_ca_is_refused() {
        let pki = pki(&["localhost"]);
        let backend = https_backend(&pki, 1);
        let relay = Relay::new(config()).unwrap();
        let url = format!("https://localhost:{}/v1/completions", backend.port);
        let failure = relay_one(&relay, 1, &url, None).unwrap_err();
        assert_eq!(
            (failure.status, failure.code, failure.backend_down),
            (502, "backend_unavailable", true)
        );
        assert_eq!(
            failure.message,
            "backend unreachable: SSLCertVerificationError"
        );
        assert!(backend.sni.recv().is_err()); // no request came: the thread ended
        assert_eq!(relay.live(), 0);
    }

    // A certificate from the trusted CA for another host name is refused too.
    #[test]
    fn a_certificate_for_another_name_is_refused() {
        let pki = pki(&["wrong.example"]);
        let (_dir, path) = ca_file(&pki.ca_pem);
        let ca = Tls::from_ca_file(&path).unwrap();
        let backend = https_backend(&pki, 1);
        let relay = Relay::new(config()).unwrap();
        let url = format!("https://localhost:{}/v1/completions", backend.port);
        let failure = relay_one(&relay, 1, &url, Some(&ca)).unwrap_err();
        assert_eq!(
            failure.message,
            "backend unreachable: SSLCertVerificationError"
        );
    }

    // An IP literal is checked against the certificate's IP addresses (no SNI is sent).
    #[test]
    fn an_ip_address_is_checked_against_the_certificates_addresses() {
        let pki = pki(&["127.0.0.1"]);
        let (_dir, path) = ca_file(&pki.ca_pem);
        let ca = Tls::from_ca_file(&path).unwrap();
        let backend = https_backend(&pki, 1);
        let relay = Relay::new(config()).unwrap();
        let url = format!("https://127.0.0.1:{}/v1/completions", backend.port);
        assert_eq!(relay_one(&relay, 1, &url, Some(&ca)), Ok(2));
        assert_eq!(backend.sni.recv().unwrap(), "");
    }

    // A CA file that cannot serve as roots is refused with what to fix.
    #[test]
    fn a_ca_file_that_is_missing_or_holds_no_certificate_is_refused() {
        let (dir, path) = ca_file("not a certificate\n");
        let missing = dir.0.join("missing.pem");
        let no_cert = Tls::from_ca_file(&path).unwrap_err();
        assert!(no_cert.ends_with("holds no PEM certificate"), "{no_cert}");
        let unread = Tls::from_ca_file(&missing).unwrap_err();
        assert!(unread.contains("cannot be read as PEM"), "{unread}");
        // a key, and no certificate: not roots either
        let (_dir, key_only) = ca_file(&KeyPair::generate().unwrap().serialize_pem());
        let keyed = Tls::from_ca_file(&key_only).unwrap_err();
        assert!(keyed.ends_with("holds no PEM certificate"), "{keyed}");
    }

    /// The gateway's client certificate, issued by another throwaway CA (its PEM returned),
    /// written to `dir` as `client.crt` and `client.key`.
    fn client_identity(dir: &std::path::Path) -> (String, std::path::PathBuf, std::path::PathBuf) {
        let mut params = CertificateParams::new(Vec::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec!["llmflow".to_owned()])
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        let (cert_file, key_file) = (dir.join("client.crt"), dir.join("client.key"));
        std::fs::write(&cert_file, cert.pem()).unwrap();
        std::fs::write(&key_file, key.serialize_pem()).unwrap();
        (ca.pem(), cert_file, key_file)
    }

    // A backend that asks for a client certificate gets the one configured, and serves; with
    // none shown, the handshake is refused by the backend and nothing is left live.
    #[test]
    fn a_backend_that_asks_for_a_client_certificate_gets_it() {
        let pki = pki(&["localhost"]);
        let (dir, path) = ca_file(&pki.ca_pem);
        let (clients_ca, cert_file, key_file) = client_identity(&dir.0);
        let identity = ClientIdentity::from_files(&cert_file, Some(&key_file)).unwrap();
        let tls = Tls::for_backend(Some(&path), Some(identity))
            .unwrap()
            .unwrap();
        let backend = https_backend_asking(&pki, 1, Some(&clients_ca));
        let relay = Relay::new(config()).unwrap();
        let url = format!("https://localhost:{}/v1/completions", backend.port);
        assert_eq!(relay_one(&relay, 1, &url, Some(&tls)), Ok(2));

        let backend = https_backend_asking(&pki, 1, Some(&clients_ca));
        let url = format!("https://localhost:{}/v1/completions", backend.port);
        let roots_only = Tls::from_ca_file(&path).unwrap();
        let failure = relay_one(&relay, 2, &url, Some(&roots_only)).unwrap_err();
        assert_eq!(
            (failure.status, failure.code, failure.backend_down),
            (502, "backend_unavailable", true)
        );
        assert_eq!(failure.message, "backend unreachable: SSLError");
        assert!(backend.sni.recv().is_err()); // no request was answered
        assert_eq!(relay.live(), 0);
    }

    // A client certificate and key that cannot be used are refused with what to fix.
    #[test]
    fn a_client_certificate_without_its_key_is_refused() {
        let dir = tempdir::Dir::new();
        let (_, cert_file, key_file) = client_identity(&dir.0);
        // the key in the certificate's file: none there
        let no_key = ClientIdentity::from_files(&cert_file, None).err().unwrap();
        assert!(
            no_key.starts_with("tls_client_cert") && no_key.ends_with("holds no PEM private key"),
            "{no_key}"
        );
        // one PEM holding both is read as Python's load_cert_chain(certfile) reads it
        let both = dir.0.join("both.pem");
        let pem = std::fs::read_to_string(&cert_file).unwrap()
            + &std::fs::read_to_string(&key_file).unwrap();
        std::fs::write(&both, pem).unwrap();
        assert!(ClientIdentity::from_files(&both, None).is_ok());
        // a key that is not the certificate's
        let other = dir.0.join("other.key");
        std::fs::write(&other, KeyPair::generate().unwrap().serialize_pem()).unwrap();
        let identity = ClientIdentity::from_files(&cert_file, Some(&other)).unwrap();
        let mismatch = Tls::for_backend(None, Some(identity)).unwrap_err();
        assert!(mismatch.starts_with("tls_client_key"), "{mismatch}");
        // a certificate file that holds no certificate
        let no_cert = ClientIdentity::from_files(&key_file, Some(&key_file))
            .err()
            .unwrap();
        assert!(no_cert.ends_with("holds no PEM certificate"), "{no_cert}");
        // neither a CA file nor a client certificate: the Mozilla default, no TLS of its own
        assert!(Tls::for_backend(None, None).unwrap().is_none());
    }

    /// A directory removed when dropped.
    mod tempdir {
        pub struct Dir(pub std::path::PathBuf);

        impl Dir {
            pub fn new() -> Self {
                use std::sync::atomic::{AtomicU32, Ordering};
                static N: AtomicU32 = AtomicU32::new(0);
                let n = N.fetch_add(1, Ordering::Relaxed);
                let path =
                    std::env::temp_dir().join(format!("llmflow-tls-{}-{n}", std::process::id()));
                std::fs::create_dir_all(&path).unwrap();
                Self(path)
            }
        }

        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }
}
