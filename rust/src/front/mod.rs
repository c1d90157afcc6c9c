//! The native front door: the public listener and every client connection, in tokio.
//!
//! The Python side binds the public socket (so `llmflow serve` keeps its host and port
//! handling, and tests their ephemeral ports) and hands its fd to [`Front`], which accepts on
//! the relay's tokio runtime, one task per connection (`conn.rs`). Each request's head is read
//! with the gateway's limits (`http.rs`). The governed generation routes are offered to a
//! [`Native`] server (the integrator's); every other request, and every one it declines, goes
//! to the FastAPI app, which uvicorn serves on a private unix socket (`pass.rs`), losing
//! nothing: method, target, headers, body, the client's address and its disconnects.

pub mod answer;
pub mod auth;
pub mod chunked;
pub mod conn;
pub mod decode;
pub mod disagg;
pub mod from_app;
pub mod governed;
pub mod http;
pub mod intake;
pub mod invalid;
pub mod json;
pub mod middleware;
pub mod origin;
pub mod owner;
pub mod pass;
pub mod prepare;
pub mod printable;
pub mod prompt;
pub mod pytext;
pub mod record;
pub mod reply;
pub mod request;
pub mod responses;
pub mod signals;
pub mod traceparent;
pub mod whole;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::sync::watch;

pub use http::Limits;

/// One client connection, between requests.
pub struct Conn {
    pub stream: tokio::net::TcpStream,
    pub peer: SocketAddr,
    /// Bytes read past the current request: a pipelined next request.
    pub buffered: BytesMut,
    /// The runtime took this connection's last request as a protected tier's: its next one
    /// is read without waiting for a turn (`intake.rs`).
    pub express: bool,
}

/// One request, its body read whole (a request offered to [`Native`]), or still on the wire
/// (one passed to the app as it arrives).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    /// The raw request-target (path and query, as the client sent it).
    pub target: String,
    /// 0 = HTTP/1.0, 1 = HTTP/1.1.
    pub version: u8,
    /// Lower-case names, raw values, in the client's order.
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Bytes,
    /// The connection may serve another request after this one.
    pub keep_alive: bool,
}

impl Request {
    /// The first value of header `name` (lower-case).
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }

    /// The path, without the query.
    pub fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or_default()
    }
}

/// What a [`Native`] server did with a request.
pub enum Outcome {
    /// Answered; the connection back for its next request, None when it is closed.
    Served(Option<Conn>),
    /// Not served: pass it to the app (nothing of it was written to the client).
    Declined(Request, Conn),
}

/// What the app does with a governed request before it reads the body (`Native::screen`).
pub enum Screen {
    /// The app's middleware answers it (`middleware.rs`: a keyless gateway's foreign Host or
    /// Origin, a declared body past the limit, a compressed body): these bytes, then the
    /// connection closes, its body unread.
    Close(Vec<u8>),
    /// The app answers it before reading the body (a bad key): with this error, no `100
    /// Continue` first, the body then read past.
    Refuse(reply::ErrorReply),
    /// The app reads the body: read it (after a `100 Continue` if asked), then `serve`.
    Read,
}

/// Serves the governed generation routes in Rust (`POST /v1/chat/completions`,
/// `/v1/completions` and `/v1/responses`, body read whole, within the limit); the rest goes to
/// the app.
pub trait Native: Send + Sync + 'static {
    fn serve(
        self: Arc<Self>,
        request: Request,
        conn: Conn,
    ) -> Pin<Box<dyn Future<Output = Outcome> + Send>>;

    /// What the app would do with `request`, its head alone known, before reading its body
    /// (a server with no guard of its own has the middleware's body limit and reads the rest).
    fn screen(&self, request: &Request, max_body_bytes: usize) -> Screen {
        middleware::middleware_answer(request, None, Some(max_body_bytes))
            .map_or(Screen::Read, Screen::Close)
    }
}

/// The front door: accepts on the public listener and serves each connection in a task.
pub struct Front {
    setup: Arc<conn::Setup>,
    /// Set once by `close`: the accept loop and every connection end.
    closed: watch::Sender<bool>,
}

const ACCEPT_BACKOFF: Duration = Duration::from_millis(10); // out of fds: let some close first

impl Front {
    /// Start accepting on `listener` (a bound, listening socket) on `runtime`, passing to the
    /// app on the unix socket `app`.
    ///
    /// # Errors
    /// The listener cannot be registered with the runtime.
    pub fn start(
        runtime: &tokio::runtime::Handle,
        listener: std::net::TcpListener,
        app: PathBuf,
        limits: Limits,
    ) -> std::io::Result<Self> {
        listener.set_nonblocking(true)?;
        let listener = {
            let _entered = runtime.enter();
            tokio::net::TcpListener::from_std(listener)?
        };
        let (closed, watching) = watch::channel(false);
        let per_round = intake::TURNS_PER_WORKER * runtime.metrics().num_workers();
        let setup = Arc::new(conn::Setup {
            limits,
            app,
            native: RwLock::new(None),
            passing: AtomicUsize::new(0),
            intake: intake::Intake::start(runtime, per_round, watching.clone()),
        });
        runtime.spawn(accept(listener, Arc::clone(&setup), watching));
        Ok(Self { setup, closed })
    }

    /// Serve the governed routes natively from now on (each request asks at its arrival).
    pub fn set_native(&self, native: Arc<dyn Native>) {
        *self.setup.native.write().expect("never poisoned") = Some(native);
    }

    /// Requests passed to the app whose reply is still being written to its client (a
    /// WebSocket counts for its whole life).
    pub fn passing(&self) -> usize {
        self.setup
            .passing
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Stop accepting and drop every connection (the process is stopping).
    pub fn close(&self) {
        self.closed.send_replace(true);
    }
}

impl Drop for Front {
    fn drop(&mut self) {
        self.close();
    }
}

/// Unsent bytes the kernel holds for a client before the socket stops being writable.
///
/// Without a bound, Linux grows a socket's send buffer (up to `tcp_wmem`'s 4 MiB) for a
/// client that reads nothing, so a stream's writes never block, its window of unwritten chunks
/// never fills, and the runtime's stall rule never hears of it: vLLM generates the whole reply
/// into kernel buffers. With it, what a stalled client costs is its receive window plus this,
/// and the window fills within a few chunks of the client stopping.
const MAX_UNSENT: libc::c_int = 16 * 1024;

fn bound_unsent(stream: &tokio::net::TcpStream) {
    use std::os::fd::AsRawFd;
    let value = MAX_UNSENT;
    // SAFETY: a valid socket fd and a c_int option value of the stated size.
    unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_NOTSENT_LOWAT,
            (&raw const value).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

async fn accept(
    listener: tokio::net::TcpListener,
    setup: Arc<conn::Setup>,
    mut closed: watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = closed.wait_for(|c| *c) => return,
        };
        let Ok((stream, peer)) = accepted else {
            // EMFILE and the like: the listener stays; try again once some have closed.
            tokio::time::sleep(ACCEPT_BACKOFF).await;
            continue;
        };
        // Replies are written whole or chunk by chunk as they come: no Nagle delay on either.
        let _ = stream.set_nodelay(true);
        bound_unsent(&stream);
        let conn = Conn {
            stream,
            peer,
            buffered: BytesMut::with_capacity(8192),
            express: false,
        };
        let (setup, mut closed) = (Arc::clone(&setup), closed.clone());
        tokio::spawn(async move {
            tokio::select! {
                () = conn::serve(setup, conn) => {}
                _ = closed.wait_for(|c| *c) => {}
            }
        });
    }
}

#[cfg(test)]
mod tests;
