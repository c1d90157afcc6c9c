//! What the relay tells its host, queued for the host's thread, with one wake-up per batch.
//!
//! Streams run on the relay's threads; the host (the gateway's event loop) drains the queue
//! when the notify pipe becomes readable. A byte is written only when none is on its way since
//! the host last took the queue, so a busy relay costs the host one wake-up per batch, not per
//! event.
//! Token counts are not urgent: they gather per request and go out every flush interval as one
//! `Tokens` batch, except that a request's count always goes out just before its own next
//! event, so the host never sees a request end before its last tokens.

use std::fs::File;
use std::io::Write;
use std::mem;
use std::sync::Mutex;

use rustc_hash::FxHashMap;

/// An upstream failure, as the client should hear it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The status to answer with (4xx passed through, 502).
    pub status: u16,
    /// `backend_unavailable`, `backend_rejected`, `backend_error`.
    pub code: &'static str,
    pub message: String,
    /// The backend could not be reached at all.
    pub backend_down: bool,
    /// The error object a backend's 4xx carried (`{"message","type","param","code"}`, as
    /// JSON): the client's mistake, which it hears in vLLM's own words.
    pub error: Option<String>,
}

impl Failure {
    /// A failure of the backend's own (502), with no error object to pass on.
    pub fn backend(code: &'static str, message: String, backend_down: bool) -> Self {
        Self {
            status: 502,
            code,
            message,
            backend_down,
            error: None,
        }
    }
}

/// One thing that happened to a relayed stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RelayEvent {
    /// Upstream answered 200: the request runs in vLLM (queued quietly: the runtime only
    /// records it, so it rides with the next batch instead of waking the host).
    Started(u64),
    /// The first generated tokens; `template` is the reply's `{"id","created","model"}`.
    FirstToken {
        id: u64,
        n: u32,
        template: Option<String>,
    },
    /// Tokens generated since the last report, per request.
    Tokens(Vec<(u64, u32)>),
    /// One `data:` payload of a stream opened `whole`, after its tokens were counted: the
    /// host assembles the reply (a client that did not ask for a stream).
    Payload(u64, Vec<u8>),
    /// Upstream sent `[DONE]`.
    Done(u64),
    /// Upstream failed (before or after the first token).
    Failed(u64, Failure),
    /// The client's window of unwritten chunks is full.
    WindowFull(u64),
    /// A full window has room again.
    WindowDrained(u64),
    /// The client closed its connection.
    ClientGone(u64),
    /// The stream is over; `socket` is the client's connection, handed back for its next
    /// request (a reply that ended cleanly on a keep-alive connection), else closed.
    Closed {
        id: u64,
        socket: Option<i32>,
        upstream_complete: bool,
        /// Tokens the stream counted in all (the host's metrics read it here, not per batch).
        completion_tokens: u64,
    },
}

#[derive(Default)]
struct Queue {
    events: Vec<RelayEvent>,
    /// A wake-up byte is on its way and the host has not taken the queue since.
    woken: bool,
}

/// The queue, the per-request token tallies and the notify pipe.
pub struct Events {
    queue: Mutex<Queue>,
    tokens: Mutex<FxHashMap<u64, u32>>,
    notify: Mutex<File>,
}

impl Events {
    pub fn new(notify: File) -> Self {
        Self {
            queue: Mutex::new(Queue::default()),
            tokens: Mutex::new(FxHashMap::default()),
            notify: Mutex::new(notify),
        }
    }

    /// Count tokens for a request (reported at the next flush or with its next event).
    pub fn add_tokens(&self, id: u64, n: u32) {
        if n > 0 {
            *self.tokens.lock().unwrap().entry(id).or_insert(0) += n;
        }
    }

    /// Queue an event for `id`, after its pending tokens.
    pub fn push(&self, id: u64, event: RelayEvent) {
        let mut tokens = self.tokens.lock().unwrap();
        let pending = tokens.remove(&id);
        let mut queue = self.queue.lock().unwrap();
        if let Some(n) = pending {
            queue.events.push(RelayEvent::Tokens(vec![(id, n)]));
        }
        queue.events.push(event);
        drop(tokens);
        self.wake(&mut queue);
    }

    /// Queue an event that need not wake the host: it goes with the next batch (the host
    /// learns of it at most one token flush late, in order).
    pub fn push_quiet(&self, event: RelayEvent) {
        self.queue.lock().unwrap().events.push(event);
    }

    /// Move every pending token count into one `Tokens` event (the periodic flush).
    pub fn flush_tokens(&self) {
        let mut tokens = self.tokens.lock().unwrap();
        if tokens.is_empty() {
            return;
        }
        let batch: Vec<(u64, u32)> = tokens.drain().collect();
        let mut queue = self.queue.lock().unwrap();
        queue.events.push(RelayEvent::Tokens(batch));
        drop(tokens);
        self.wake(&mut queue);
    }

    /// Everything queued, oldest first.
    pub fn take(&self) -> Vec<RelayEvent> {
        let mut queue = self.queue.lock().unwrap();
        queue.woken = false;
        mem::take(&mut queue.events)
    }

    /// One byte per batch: none while one is on its way and the queue not yet taken.
    fn wake(&self, queue: &mut Queue) {
        if !queue.woken {
            queue.woken = true;
            // A full pipe already holds a wake-up; any other error means the host is gone.
            let _ = self.notify.lock().unwrap().write(&[1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::OwnedFd;
    use std::os::unix::net::UnixStream;

    fn events() -> (Events, UnixStream) {
        let (tx, rx) = UnixStream::pair().unwrap();
        rx.set_nonblocking(true).unwrap();
        (Events::new(File::from(OwnedFd::from(tx))), rx)
    }

    fn bytes(rx: &mut UnixStream) -> usize {
        let mut buf = [0u8; 16];
        rx.read(&mut buf).unwrap_or(0)
    }

    #[test]
    fn one_wake_per_batch_and_quiet_events_wait_for_it() {
        let (ev, mut rx) = events();
        ev.push_quiet(RelayEvent::Started(1));
        assert_eq!(bytes(&mut rx), 0, "a quiet event wakes nobody");
        ev.push(1, RelayEvent::Done(1));
        ev.push(2, RelayEvent::Done(2));
        assert_eq!(bytes(&mut rx), 1, "one byte for the batch");
        assert_eq!(
            ev.take(),
            vec![
                RelayEvent::Started(1),
                RelayEvent::Done(1),
                RelayEvent::Done(2)
            ]
        );
        ev.push(3, RelayEvent::Done(3));
        assert_eq!(bytes(&mut rx), 1, "taken: the next event wakes again");
    }

    #[test]
    fn a_request_s_tokens_go_out_before_its_next_event() {
        let (ev, _rx) = events();
        ev.add_tokens(7, 3);
        ev.add_tokens(8, 1);
        ev.add_tokens(7, 2);
        ev.push(7, RelayEvent::Done(7));
        ev.flush_tokens();
        let got = ev.take();
        assert_eq!(
            got,
            vec![
                RelayEvent::Tokens(vec![(7, 5)]),
                RelayEvent::Done(7),
                RelayEvent::Tokens(vec![(8, 1)]),
            ]
        );
    }
}
