//! The app's reply, copied to the client as it comes (`pass.rs`): interim heads, the head,
//! then the body, each read from the app written to the client at once (an SSE reply goes out
//! chunk by chunk), its framing followed only to know where it ends.

use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::chunked::Chunked;
use super::http::{tokens, Framing};

const MAX_REPLY_HEAD: usize = 1 << 20; // the app's reply heads are small; past this it is broken

/// Why a reply did not come through whole.
pub enum Failed {
    /// The app closed before a byte of a reply: the client is answered 502.
    Silent,
    /// A side went mid-reply: the client's connection is dropped.
    Cut,
}

/// A reply copied whole.
pub struct Reply {
    /// The connection ends after it (`connection: close`, or a body that ends with it).
    pub close: bool,
    /// `101 Switching Protocols`: the connection is the app's protocol's from now on.
    pub upgraded: bool,
}

/// The client's side of a reply: its socket, and how long it may take none of a write.
pub struct Client<'a, W> {
    pub stream: &'a mut W,
    pub write_timeout: Duration,
}

impl<W: AsyncWrite + Unpin> Client<'_, W> {
    /// Write `bytes`; a client gone, or one that took none of them for the write timeout (as
    /// the Python listener's write timer aborts it), cuts the reply.
    async fn write(&mut self, bytes: &[u8]) -> Result<(), Failed> {
        match tokio::time::timeout(self.write_timeout, self.stream.write_all(bytes)).await {
            Ok(Ok(())) => Ok(()),
            _ => Err(Failed::Cut),
        }
    }
}

/// Copy the app's reply to the client: interim heads, the head, the body as it comes.
pub async fn download<R, W>(
    app: &mut R,
    buf: &mut BytesMut,
    mut client: Client<'_, W>,
    head_only: bool,
) -> Result<Reply, Failed>
where
    R: AppSide,
    W: AsyncWrite + Unpin,
{
    let mut wrote = false;
    loop {
        let (len, status, framing, close) = loop {
            match reply_head(buf) {
                Ok(Some(head)) => break head,
                Ok(None) if buf.len() < MAX_REPLY_HEAD => {}
                _ => return Err(Failed::Cut),
            }
            if matches!(app.read_buf(buf).await, Ok(0) | Err(_)) {
                return Err(if wrote { Failed::Cut } else { Failed::Silent });
            }
        };
        let head = buf.split_to(len);
        client.write(&head).await?;
        wrote = true;
        if status == 101 {
            return Ok(Reply {
                close: false,
                upgraded: true,
            });
        }
        if (100..200).contains(&status) {
            continue; // 100 Continue: the final reply follows
        }
        let framing = if head_only || status == 204 || status == 304 {
            Some(Framing::Length(0))
        } else {
            framing
        };
        copy_body(app, buf, &mut client, framing, close).await?;
        return Ok(Reply {
            close: close || framing.is_none(),
            upgraded: false,
        });
    }
}

/// A reply's head: its length, status, body framing (None: until the app closes) and whether
/// it ends the connection.
type ReplyHead = (usize, u16, Option<Framing>, bool);

fn reply_head(buf: &[u8]) -> Result<Option<ReplyHead>, Failed> {
    let mut headers = [httparse::EMPTY_HEADER; 128];
    let mut reply = httparse::Response::new(&mut headers);
    let len = match reply.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(_) => return Err(Failed::Cut),
    };
    let (mut framing, mut close, mut keep) = (None, false, false);
    for h in reply.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            let n = std::str::from_utf8(h.value)
                .ok()
                .and_then(|t| t.trim().parse().ok());
            framing = Some(Framing::Length(n.ok_or(Failed::Cut)?));
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            framing = Some(Framing::Chunked);
        } else if h.name.eq_ignore_ascii_case("connection") {
            for token in tokens(h.value) {
                close |= token.eq_ignore_ascii_case(b"close");
                keep |= token.eq_ignore_ascii_case(b"keep-alive");
            }
        }
    }
    let close = close || (reply.version == Some(0) && !keep);
    Ok(Some((len, reply.code.unwrap_or(0), framing, close)))
}

/// The app's side of a passed request: can it tell, without reading, that the app hung up?
pub trait AppSide: AsyncRead + Unpin {
    /// The app closed its side (data may still wait unread before the end).
    fn hung_up(&self) -> bool;
}

impl AppSide for tokio::net::unix::ReadHalf<'_> {
    fn hung_up(&self) -> bool {
        use std::os::fd::AsRawFd;
        let stream: &tokio::net::UnixStream = self.as_ref();
        let mut poll = libc::pollfd {
            fd: stream.as_raw_fd(),
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one valid pollfd, a zero timeout: a check, never a wait.
        let ready = unsafe { libc::poll(&raw mut poll, 1, 0) };
        ready > 0 && poll.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
    }
}

/// How often a write waiting on a client that reads nothing checks whether the app hung up.
const HANG_UP_CHECK: Duration = Duration::from_millis(100);

/// Copy one reply body verbatim, each read from the app written to the client at once.
///
/// While a write waits on a client that reads nothing, the app's side is checked: an app that
/// hangs up on a framed reply it did not say would end the connection has cut it (the
/// runtime's stall rule, a drain; `guard.py` aborts a connection whose buffer does not
/// flush), so the client's connection is dropped then, not when the write timeout gives up.
async fn copy_body<R, W>(
    app: &mut R,
    buf: &mut BytesMut,
    client: &mut Client<'_, W>,
    framing: Option<Framing>,
    close: bool,
) -> Result<(), Failed>
where
    R: AppSide,
    W: AsyncWrite + Unpin,
{
    let mut left = match framing {
        Some(Framing::Length(n)) => n,
        _ => u64::MAX,
    };
    let mut chunked = (framing == Some(Framing::Chunked)).then(Chunked::default);
    let watch = framing.is_some() && !close;
    while left > 0 && !chunked.as_ref().is_some_and(Chunked::done) {
        if buf.is_empty() {
            match app.read_buf(buf).await {
                Ok(0) if framing.is_none() => return Ok(()), // the body ends with the connection
                Ok(0) | Err(_) => return Err(Failed::Cut),
                Ok(_) => {}
            }
        }
        let take = match chunked.as_mut() {
            Some(c) => c.feed(buf).map_err(|_| Failed::Cut)?,
            None => left.min(buf.len() as u64) as usize,
        };
        if chunked.is_none() && framing.is_some() {
            left -= take as u64;
        }
        let part = buf.split_to(take);
        let mut write = std::pin::pin!(client.write(&part));
        loop {
            tokio::select! {
                written = &mut write => {
                    written?;
                    break;
                }
                () = tokio::time::sleep(HANG_UP_CHECK), if watch => {
                    if app.hung_up() && !reply_complete(chunked.as_ref(), left, buf) {
                        return Err(Failed::Cut); // the app cut it: drop the client now
                    }
                }
            }
        }
    }
    Ok(())
}

/// Whether what is already read (`buf`, after the part being written) ends the reply.
fn reply_complete(chunked: Option<&Chunked>, left: u64, buf: &BytesMut) -> bool {
    match chunked {
        Some(c) => {
            let mut rest = c.clone();
            let mut probe = buf.clone();
            while !probe.is_empty() && !rest.done() {
                match rest.feed(&probe) {
                    Ok(0) | Err(_) => return false,
                    Ok(n) => {
                        let _ = probe.split_to(n);
                    }
                }
            }
            rest.done()
        }
        None => buf.len() as u64 >= left,
    }
}
