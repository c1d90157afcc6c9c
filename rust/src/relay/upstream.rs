//! Connections to vLLM that the stream owns while it uses them.
//!
//! A stream polls its connection's driver inside its own task, so closing the connection
//! (an abort, a client gone) is a `close` on the socket in that same step: vLLM sees the
//! disconnect before the host hears of it and before the runtime can start anything in the
//! freed slot. (A pool whose connections run as tasks of their own, as hyper-util's client
//! does, closes them a wake-up later, and a new request can reach vLLM first: the cap, as vLLM
//! counts it, would be passed for a moment.) Connections that finished a reply cleanly wait
//! here for the next request to the same backend.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::client::conn::http1::{self, Connection, SendRequest};
use hyper_util::rt::TokioIo;
use rustc_hash::FxHashMap;
use tokio::net::TcpStream;

/// The driver of one HTTP/1.1 connection (reads and writes the socket when polled).
pub type Driver = Pin<Box<Connection<TokioIo<TcpStream>, Full<Bytes>>>>;

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

/// Idle connections per backend (`host:port`).
#[derive(Default)]
pub struct Pool {
    idle: Mutex<FxHashMap<String, Vec<Idle>>>,
}

impl Pool {
    /// An idle connection to `authority` that is still open, or a new one.
    ///
    /// # Errors
    /// The backend cannot be reached within `timeout`.
    pub async fn checkout(&self, authority: &str, timeout: Duration) -> io::Result<Conn> {
        while let Some(idle) = self.pop(authority) {
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
        Self::connect(authority, timeout).await
    }

    /// A new connection to `authority`.
    ///
    /// # Errors
    /// The backend cannot be reached within `timeout`.
    pub async fn connect(authority: &str, timeout: Duration) -> io::Result<Conn> {
        let stream = tokio::time::timeout(timeout, TcpStream::connect(authority))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))??;
        stream.set_nodelay(true)?;
        let (sender, driver) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(io::Error::other)?;
        Ok(Conn {
            sender,
            driver: Box::pin(driver),
            reused: false,
        })
    }

    /// Keep a connection whose last reply ended cleanly.
    pub fn checkin(&self, authority: &str, conn: Conn) {
        let mut idle = self.idle.lock().unwrap();
        let list = idle.entry(authority.to_owned()).or_default();
        if list.len() < IDLE_PER_BACKEND {
            list.push(Idle {
                conn,
                since: Instant::now(),
            });
        }
    }

    fn pop(&self, authority: &str) -> Option<Idle> {
        self.idle.lock().unwrap().get_mut(authority)?.pop()
    }
}
