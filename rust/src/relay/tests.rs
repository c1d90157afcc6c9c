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
        let events = [
            chunk("a", None),
            chunk("b", Some("length")),
            "data: [DONE]\n\n".into(),
        ];
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

// The stream's task can read vLLM's first token before the request's task lends it the
// client's socket (they run on different threads): the head, held for the first token, must
// still go out first, with every chunk after it, and the socket come back after the end.
#[test]
fn a_socket_lent_after_the_first_token_gets_the_whole_reply() {
    let relay = Relay::new(config()).unwrap();
    let (sink, mut events) = tokio::sync::mpsc::unbounded_channel();
    let url = backend();
    let request = StreamRequest {
        id: 7,
        url: &url,
        body: b"{\"model\":\"m\",\"prompt\":\"x\",\"stream\":true}".to_vec(),
        request_id: "llmflow-7",
        traceparent: None,
        include_usage: false,
        continuous_usage: false,
        choices: 1,
        unstreamed: false,
        whole: false,
        sink,
    };
    relay.open(request).unwrap();
    loop {
        match events.blocking_recv() {
            Some(RelayEvent::FirstToken { .. }) => break,
            Some(_) => {}
            None => panic!("the stream ended before its first token"),
        }
    }
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (lent, _) = listener.accept().unwrap();
    let hold = Control::Hold {
        socket: lent,
        head: HEAD.to_vec(),
        keep_alive: true,
    };
    assert!(relay.control(7, hold));
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
                let fd = socket.expect("a clean end hands the socket back");
                // SAFETY: the relay handed this socket over; it is closed here.
                drop(unsafe { <TcpStream as std::os::fd::FromRawFd>::from_raw_fd(fd) });
                break;
            }
            Some(_) => {}
            None => panic!("no Closed event"),
        }
    }
}
