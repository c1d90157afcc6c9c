//! The front end to end over loopback: a client, the front with a native server, and a fake
//! app on a unix socket that records what it was sent.

use std::io::{Read, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

/// Serves a request whose body is `serve` itself (and hands the connection back even when the
/// request said close: the loop closes it); declines every other.
struct Picky;

impl Native for Picky {
    fn serve(
        self: Arc<Self>,
        request: Request,
        mut conn: Conn,
    ) -> Pin<Box<dyn Future<Output = Outcome> + Send>> {
        Box::pin(async move {
            if request.body.as_ref() != b"serve" {
                return Outcome::Declined(request, conn);
            }
            let reply = b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nnative";
            conn.stream.write_all(reply).await.unwrap();
            Outcome::Served(Some(conn))
        })
    }
}

/// A fake app: reads requests (head and Content-Length body) off each connection, records
/// them, answers each with `app`.
async fn fake_app(listener: tokio::net::UnixListener, seen: Arc<Mutex<Vec<Vec<u8>>>>) {
    {
        while let Ok((mut stream, _)) = listener.accept().await {
            let seen = Arc::clone(&seen);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    let mut headers = [httparse::EMPTY_HEADER; 32];
                    let mut req = httparse::Request::new(&mut headers);
                    if let Ok(httparse::Status::Complete(len)) = req.parse(&buf) {
                        let body: usize = req
                            .headers
                            .iter()
                            .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                            .map_or(0, |h| {
                                std::str::from_utf8(h.value).unwrap().parse().unwrap()
                            });
                        if buf.len() >= len + body {
                            seen.lock().unwrap().push(buf.drain(..len + body).collect());
                            let reply = b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\napp";
                            stream.write_all(reply).await.unwrap();
                            continue;
                        }
                    }
                    let mut chunk = [0u8; 4096];
                    match stream.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
            });
        }
    }
}

/// A runtime of one worker thread, as the front's tests run it.
fn one_worker() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

/// A front on a free loopback port of `runtime`, passing to the app at `app` what `native`
/// declines: the front, and its port.
fn start_front(
    runtime: &tokio::runtime::Runtime,
    app: std::path::PathBuf,
    native: Arc<dyn Native>,
) -> (Front, u16) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let limits = Limits {
        max_header_bytes: 8192,
        max_body_bytes: 1024,
        read_timeout: Duration::from_secs(10),
        keep_alive_timeout: Duration::from_secs(10),
        write_timeout: Duration::from_secs(10),
    };
    let front = Front::start(runtime.handle(), listener, app, limits).unwrap();
    front.set_native(native);
    (front, port)
}

fn post(body: &str, last: bool) -> String {
    let close = if last { "connection: close\r\n" } else { "" };
    format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\n{close}content-length: {}\r\n\r\n{body}",
        body.len()
    )
}

// Pipelined requests are answered in order, whichever side answers each: the native server
// what it serves, the app (with the body read already, and the client's address) what it
// declines and what is not offered to it.
#[test]
fn native_then_declined_then_passed_in_order() {
    let runtime = one_worker();
    let dir = std::env::temp_dir().join(format!("llmflow-front-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let app_path = dir.join("app.sock");
    let _ = std::fs::remove_file(&app_path);
    let seen = Arc::new(Mutex::new(Vec::new()));
    {
        let _entered = runtime.enter();
        let app = tokio::net::UnixListener::bind(&app_path).unwrap();
        runtime.spawn(fake_app(app, Arc::clone(&seen)));
    }
    let (front, port) = start_front(&runtime, app_path.clone(), Arc::new(Picky));

    let mut client = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let passed = "GET /v1/models HTTP/1.1\r\nx-llmflow-peer: 6.6.6.6:6\r\n\r\n";
    let sent = [
        post("serve", false),
        post("decline", false),
        passed.to_owned(),
        post("serve", true),
    ];
    client.write_all(sent.concat().as_bytes()).unwrap();
    let mut replies = String::new();
    client.read_to_string(&mut replies).unwrap();
    let bodies: Vec<&str> = replies
        .split("\r\n\r\n")
        .skip(1)
        .map(|r| &r[..r.find("HTTP").unwrap_or(r.len())])
        .collect();
    assert_eq!(bodies, ["native", "app", "app", "native"]);

    let peer = client.local_addr().unwrap().to_string();
    let seen = seen.lock().unwrap();
    let seen: Vec<String> = seen
        .iter()
        .map(|r| String::from_utf8_lossy(r).into_owned())
        .collect();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!(
        seen[0].starts_with("POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 7\r\n")
    );
    assert!(
        seen[0].ends_with(&format!("x-llmflow-peer: {peer}\r\n\r\ndecline")),
        "{}",
        seen[0]
    );
    assert_eq!(
        seen[1],
        format!("GET /v1/models HTTP/1.1\r\nx-llmflow-peer: {peer}\r\n\r\n")
    );
    front.close();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Serves every request with a 200, noting its body in the order served; a request whose body
/// is `vip` marks its connection as a protected tier's (as `Governed` does from the runtime).
struct Ordered(Mutex<Vec<String>>);

impl Native for Ordered {
    fn serve(
        self: Arc<Self>,
        request: Request,
        mut conn: Conn,
    ) -> Pin<Box<dyn Future<Output = Outcome> + Send>> {
        Box::pin(async move {
            let body = String::from_utf8_lossy(&request.body).into_owned();
            conn.express = body == "vip";
            self.0.lock().unwrap().push(body);
            let reply = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
            conn.stream.write_all(reply).await.unwrap();
            Outcome::Served(Some(conn))
        })
    }
}

// A protected tier's connection is read before the crowd that was ready ahead of it, not
// behind all of it: 150 crowd requests, then the VIP's, then 50 more, all land while the
// front's one worker is busy; without turns, the VIP's is served 151st.
#[test]
fn a_protected_connection_is_read_before_the_crowd_ahead_of_it() {
    let runtime = one_worker();
    let served = Arc::new(Ordered(Mutex::default()));
    let app = std::env::temp_dir().join("llmflow-front-test-no-app.sock");
    let (front, port) = start_front(&runtime, app, Arc::clone(&served) as Arc<dyn Native>);
    let connect = || {
        let stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        stream
    };
    let answered = |stream: &mut std::net::TcpStream| {
        let mut reply = [0u8; 40];
        stream.read_exact(&mut reply).unwrap();
        assert!(reply.ends_with(b"ok"));
    };
    let mut vip = connect();
    vip.write_all(post("vip", false).as_bytes()).unwrap();
    answered(&mut vip);
    let mut crowd: Vec<_> = (0..200).map(|_| connect()).collect();
    std::thread::sleep(Duration::from_millis(300)); // every connection accepted, and idle
    served.0.lock().unwrap().clear();

    let busy = runtime.spawn(async { std::thread::sleep(Duration::from_millis(300)) });
    std::thread::sleep(Duration::from_millis(50)); // the worker is in it
    for (i, stream) in crowd.iter_mut().enumerate() {
        if i == 150 {
            vip.write_all(post("vip", false).as_bytes()).unwrap();
        }
        stream.write_all(post("crowd", false).as_bytes()).unwrap();
    }
    runtime.block_on(busy).unwrap();
    answered(&mut vip);
    for stream in &mut crowd {
        answered(stream);
    }
    let order = served.0.lock().unwrap().clone();
    assert_eq!(order.len(), 201);
    let at = order.iter().position(|body| body == "vip").unwrap();
    // The first round (one worker: 16 turns) is read before the VIP task comes up; the second
    // only after it.
    assert!(
        at <= intake::TURNS_PER_WORKER,
        "the VIP's request was served after {at} of the crowd's"
    );
    front.close();
}
