//! Pass-through to the FastAPI app, which uvicorn serves on a private unix socket.
//!
//! Each client connection gets one app connection, opened at its first passed request, kept
//! for its keep-alive requests and closed when the client goes, so uvicorn sees the
//! disconnect (`http.disconnect`) the moment the client does. The head is written again from
//! the parsed request, plus `x-llmflow-peer: IP:PORT` (the client's address, which the app's
//! `PeerFromFront` middleware makes the scope's `client`; one the client sent is dropped).
//! Bodies are copied verbatim both ways, each read written at once: an SSE reply reaches
//! the client chunk by chunk, an upload the app as it arrives, an interim `100 Continue` the
//! client, and a `101 Switching Protocols` turns the two connections into one pipe (the
//! WebSocket). The framing is followed only to know where each message ends. (A hyper client
//! would re-encode heads and bodies, swallow interim replies and leave undefined what
//! happens to a body still being sent when the app answers early, as its 413 does.)

use std::future::{poll_fn, Future};
use std::net::SocketAddr;
use std::path::Path;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::task::Poll;
use std::time::SystemTime;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::UnixStream;

use super::answer::{answer, uvicorn_error};
use super::chunked::Chunked;
use super::from_app::{download, Client, Failed};
use super::http::{Framing, Limits, Refusal};
use super::{Conn, Request};

/// The header that carries the client's address to the app.
pub const PEER_HEADER: &str = "x-llmflow-peer";
const WATCH_BUFFER: usize = 64 * 1024; // pipelined bytes read ahead while a reply is written

/// One client connection's connection to the app.
pub struct Upstream {
    stream: UnixStream,
    /// Read from the app past the current reply (nothing, unless it upgraded).
    buf: BytesMut,
}

/// A request's body: read whole already, or still on the client's socket.
pub enum Body {
    Read,
    Wire(Framing),
}

/// What the client connection does after a passed request.
#[derive(Debug, PartialEq, Eq)]
pub enum After {
    /// Serve its next request.
    KeepAlive,
    /// The reply said close (or the client did): end it gracefully.
    Close,
    /// The client or the app went mid-request: drop it now.
    Drop,
}

/// Why the upload stopped.
enum Stop {
    ClientGone,
    /// The app stopped reading, or the body cannot be framed (what was read went to the app,
    /// whose parser refuses it as on the port): the app's answer is what the client gets.
    AppClosed,
}

/// Pass `request` to the app on `upstream` (opened on `app` if need be) and its reply to the
/// client. On `After::Drop` or `After::Close` the caller drops the connection, the app's too.
pub async fn forward(
    app: &Path,
    upstream: &mut Option<Upstream>,
    conn: &mut Conn,
    request: &Request,
    body: Body,
    limits: &Limits,
) -> After {
    let up = match connect(app, upstream).await {
        Ok(up) => up,
        Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
            // Out of descriptors for the app's side of this connection: the Python listener's
            // answer to a connection it has no descriptors for.
            let answer = answer(Refusal::OutOfFds, SystemTime::now());
            let _ = conn.stream.write_all(&answer).await;
            return After::Close;
        }
        Err(_) => return unreachable_app(&mut conn.stream).await,
    };
    if up
        .stream
        .write_all(&head_bytes(request, conn.peer))
        .await
        .is_err()
    {
        return unreachable_app(&mut conn.stream).await;
    }
    // A body read already goes as one that is still arriving would: beside the reply, so an
    // app that answers before reading it all is heard.
    let (read, framing) = match body {
        Body::Read => (request.body.as_ref(), Framing::Length(0)),
        Body::Wire(framing) => (&[][..], framing),
    };
    let sent = AtomicBool::new(false); // the body is all with the app
    let Conn {
        stream, buffered, ..
    } = conn;
    let Upstream {
        stream: app_stream,
        buf,
    } = up;
    let outcome = {
        let (mut client_in, mut client_out) = stream.split();
        let (mut app_in, mut app_out) = app_stream.split();
        let mut upload = pin!(async {
            app_out.write_all(read).await.map_err(|_| Stop::AppClosed)?;
            upload(&mut client_in, buffered, &mut app_out, framing).await?;
            sent.store(true, Relaxed);
            watch(&mut client_in, buffered).await
        });
        let head_only = request.method == "HEAD";
        let to_client = Client {
            stream: &mut client_out,
            write_timeout: limits.write_timeout,
        };
        let mut download = pin!(download(&mut app_in, buf, to_client, head_only));
        let reply = tokio::select! {
            biased;
            reply = &mut download => reply,
            stop = &mut upload => match stop {
                Err(Stop::ClientGone) => return After::Drop,
                // The app stopped reading the body (or it cannot be framed): its answer is on
                // its way; the rest of the body is dropped by the caller's linger.
                _ => match download.await {
                    Ok(reply) if !reply.upgraded => return After::Close,
                    other => other,
                },
            },
        };
        match reply {
            Ok(reply) if reply.upgraded || sent.load(Relaxed) => Ok(reply),
            Ok(reply) if reply.close || !request.keep_alive => return After::Close,
            Ok(reply) => {
                // Answered early on a kept-alive connection: the rest of the body still goes
                // (uvicorn reads and drops it) before the next request.
                let stopped = poll_fn(|cx| match upload.as_mut().poll(cx) {
                    Poll::Ready(stop) => Poll::Ready(Some(stop)),
                    Poll::Pending if sent.load(Relaxed) => Poll::Ready(None),
                    Poll::Pending => Poll::Pending,
                })
                .await;
                if stopped.is_some() {
                    return After::Drop;
                }
                Ok(reply)
            }
            Err(failed) => Err(failed),
        }
    };
    match outcome {
        Ok(reply) if reply.upgraded => splice(stream, buffered, app_stream, buf).await,
        Ok(reply) if !reply.close && request.keep_alive => After::KeepAlive,
        Ok(_) => After::Close,
        Err(Failed::Silent) => unreachable_app(stream).await,
        Err(Failed::Cut) => After::Drop,
    }
}

/// The connection to the app: the open one if the app has not closed it, else a new one.
async fn connect<'a>(
    app: &Path,
    upstream: &'a mut Option<Upstream>,
) -> std::io::Result<&'a mut Upstream> {
    if let Some(up) = upstream.as_ref() {
        // Readable now means closed (or broken): uvicorn sends nothing between replies.
        let mut probe = [0u8; 1];
        if !matches!(up.stream.try_read(&mut probe), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
        {
            *upstream = None;
        }
    }
    if upstream.is_none() {
        let stream = UnixStream::connect(app).await?;
        *upstream = Some(Upstream {
            stream,
            buf: BytesMut::with_capacity(8192),
        });
    }
    Ok(upstream.as_mut().expect("connected above"))
}

/// The request's head as the app gets it: the client's, with the client's address added.
pub fn head_bytes(request: &Request, peer: SocketAddr) -> Vec<u8> {
    let mut out = Vec::with_capacity(512);
    out.extend_from_slice(request.method.as_bytes());
    out.push(b' ');
    out.extend_from_slice(request.target.as_bytes());
    out.extend_from_slice(if request.version == 0 {
        b" HTTP/1.0\r\n"
    } else {
        b" HTTP/1.1\r\n"
    });
    for (name, value) in request.headers.iter().filter(|(n, _)| n != PEER_HEADER) {
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(format!("{PEER_HEADER}: {peer}\r\n\r\n").as_bytes());
    out
}

/// Copy the body from the client to the app as it arrives.
async fn upload<R, W>(
    client: &mut R,
    buffered: &mut BytesMut,
    app: &mut W,
    framing: Framing,
) -> Result<(), Stop>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut left = match framing {
        Framing::Length(n) => n,
        Framing::Chunked => u64::MAX,
    };
    let mut chunked = (framing == Framing::Chunked).then(Chunked::default);
    while left > 0 && !chunked.as_ref().is_some_and(Chunked::done) {
        if buffered.is_empty() && matches!(client.read_buf(buffered).await, Ok(0) | Err(_)) {
            return Err(Stop::ClientGone);
        }
        let take = match chunked.as_mut().map(|c| c.feed(buffered)) {
            Some(Ok(n)) => n,
            Some(Err(_)) => {
                // Nothing past a framing error is read: where this body ends is then unknown,
                // and what follows must not reach the app as a request of its own.
                let _ = app.write_all(&buffered.split()).await;
                return Err(Stop::AppClosed);
            }
            None => left.min(buffered.len() as u64) as usize,
        };
        if chunked.is_none() {
            left -= take as u64;
        }
        let part = buffered.split_to(take);
        app.write_all(&part).await.map_err(|_| Stop::AppClosed)?;
    }
    Ok(())
}

/// While the reply is written: read ahead what the client pipelines, and hear it leave.
async fn watch<R: AsyncRead + Unpin>(client: &mut R, buffered: &mut BytesMut) -> Result<(), Stop> {
    loop {
        if buffered.len() >= WATCH_BUFFER {
            std::future::pending::<()>().await;
        }
        if matches!(client.read_buf(buffered).await, Ok(0) | Err(_)) {
            return Err(Stop::ClientGone);
        }
    }
}

/// After a `101`: what either side sent early goes first, then bytes flow both ways until one
/// side closes.
async fn splice(
    client: &mut tokio::net::TcpStream,
    early: &mut BytesMut,
    app: &mut UnixStream,
    from_app: &mut BytesMut,
) -> After {
    if app.write_all(&early.split()).await.is_err()
        || client.write_all(&from_app.split()).await.is_err()
    {
        return After::Drop;
    }
    let _ = tokio::io::copy_bidirectional(client, app).await;
    After::Drop
}

/// The app's socket cannot be reached (it is starting or has stopped): a 502, then close.
async fn unreachable_app(client: &mut tokio::net::TcpStream) -> After {
    let message = "the gateway's application server is not reachable; retry shortly";
    let answer = uvicorn_error(
        502,
        "Bad Gateway",
        message,
        "backend_unavailable",
        SystemTime::now(),
    );
    let _ = client.write_all(&answer).await;
    After::Close
}
