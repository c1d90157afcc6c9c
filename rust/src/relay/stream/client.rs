//! The client side of a stream: the window of chunks not yet written, coalescing, the
//! vectored writes to the client's socket, and the end of the reply.

use std::io::IoSlice;

use crate::relay::chunk::merge_frames;

use super::*;

impl Task {
    pub(super) fn occupancy(&self) -> usize {
        self.held.len() + self.out_frames
    }

    pub(super) fn add_frame(&mut self, frame: Vec<u8>, now: Instant) {
        let interval = self.shared.config.flush_interval;
        if interval.is_zero() {
            self.enqueue(&frame);
        } else if self.held.is_empty()
            && self
                .last_flush
                .is_none_or(|t| now.duration_since(t) >= interval)
        {
            self.last_flush = Some(now);
            self.enqueue(&frame);
        } else {
            self.held.push(frame);
            if self.flush_at.is_none() {
                let due = self.last_flush.unwrap_or(now) + interval;
                self.flush_at = Some(tokio::time::Instant::from_std(due));
            }
        }
        self.check_full();
    }

    pub(super) fn enqueue(&mut self, frame: &[u8]) {
        let cap = self.shared.config.client_window;
        if !self.shared.config.pause_when_full && self.occupancy() >= cap {
            // Merge into the newest waiting piece: the count stays bounded; the bytes are
            // bounded by the request's max_tokens.
            let writing_front = self.out.len() == 1 && self.written > 0;
            if let Some(last) = self.out.back_mut().filter(|p| p.frame && !writing_front) {
                last.bytes.extend_from_slice(&chunked(frame));
                return;
            }
        }
        self.push_frame(frame);
    }

    pub(super) fn push_frame(&mut self, frame: &[u8]) {
        self.out.push_back(Piece {
            bytes: chunked(frame),
            frame: true,
        });
        self.out_frames += 1;
    }

    pub(super) fn flush_held(&mut self) {
        self.flush_at = None;
        if self.held.is_empty() {
            return;
        }
        self.last_flush = Some(Instant::now());
        let held = std::mem::take(&mut self.held);
        for frame in merge_frames(held) {
            self.push_frame(&frame);
        }
    }

    pub(super) fn check_full(&mut self) {
        let cap = self.shared.config.client_window;
        let occupied = self.occupancy();
        if !self.full && occupied >= cap {
            self.full = true;
            self.push(RelayEvent::WindowFull(self.id));
        } else if self.full && occupied < cap {
            self.full = false;
            self.push(RelayEvent::WindowDrained(self.id));
        }
    }

    /// A held connection's head goes out, before what waits (`Control::Hold`): at the first
    /// token, or at the reply's end. Chunks before it (the role chunk) wait with it, so a
    /// failure before any token can still be answered with a status of its own.
    pub(super) fn release_head(&mut self) {
        if let Some(head) = self.held_head.take() {
            self.out.push_front(Piece {
                bytes: head,
                frame: false,
            });
        }
    }

    /// `[DONE]` and the end of the chunked body, after whatever is held.
    pub(super) fn terminate(&mut self) {
        if self.terminated {
            return;
        }
        self.terminated = true;
        if self.open.whole {
            return; // nothing is written: the host has had every payload
        }
        self.flush_held();
        self.release_head();
        // A Responses reply ends with its last event (vLLM's own stream has no `[DONE]`).
        let mut tail = match self.open.kind {
            ReplyKind::Chunks => chunked(DONE_FRAME),
            ReplyKind::Events => Vec::new(),
        };
        tail.extend_from_slice(b"0\r\n\r\n");
        self.out.push_back(Piece {
            bytes: tail,
            frame: false,
        });
    }

    /// Write what the socket takes now, without waiting.
    pub(super) fn write(&mut self) -> Step {
        let Some(client) = self.client.as_ref() else {
            return Step::Go;
        };
        if self.held_head.is_some() {
            return Step::Go; // held: nothing goes out before the first token
        }
        while !self.out.is_empty() {
            let wrote = if self.out.len() == 1 {
                client.try_write(&self.out[0].bytes[self.written..]) // a chunk as it comes
            } else {
                let mut slices = [IoSlice::new(&[]); WRITE_BATCH];
                let mut count = 0;
                for (slice, piece) in slices.iter_mut().zip(&self.out) {
                    let from = if count == 0 { self.written } else { 0 };
                    *slice = IoSlice::new(&piece.bytes[from..]);
                    count += 1;
                }
                client.try_write_vectored(&slices[..count])
            };
            match wrote {
                Ok(0) => return self.client_gone(),
                Ok(mut n) => {
                    let now = Instant::now();
                    if let Some(last) = self.last_write {
                        self.shared.stats.observe_gap(now.duration_since(last));
                    }
                    self.last_write = Some(now);
                    while n > 0 {
                        let left = self.out[0].bytes.len() - self.written;
                        if n >= left {
                            n -= left;
                            self.written = 0;
                            if self.out.pop_front().is_some_and(|p| p.frame) {
                                self.out_frames -= 1;
                            }
                        } else {
                            self.written += n;
                            n = 0;
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => return self.client_gone(),
            }
        }
        self.check_full();
        Step::Go
    }

    pub(super) fn client_gone(&mut self) -> Step {
        // Close upstream before the host hears of it: vLLM sees the abort before the runtime
        // can start another request in the freed slot.
        self.stop_upstream();
        self.client = None;
        self.clean = false;
        self.push(RelayEvent::ClientGone(self.id));
        Step::Stop
    }
}

/// Bytes waiting for the client's socket.
pub(super) struct Piece {
    pub(super) bytes: Vec<u8>,
    /// A chunk of the reply (counts in the window), not the head or the end.
    pub(super) frame: bool,
}

/// One HTTP/1.1 chunk carrying `data` (one allocation: a chunk goes out per token).
pub(super) fn chunked(data: &[u8]) -> Vec<u8> {
    let mut size = [0u8; 16];
    let mut at = size.len();
    let mut n = data.len();
    loop {
        at -= 1;
        size[at] = b"0123456789abcdef"[n & 0xf];
        n >>= 4;
        if n == 0 {
            break;
        }
    }
    let mut out = Vec::with_capacity(size.len() - at + data.len() + 4);
    out.extend_from_slice(&size[at..]);
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
    out
}

#[cfg(unix)]
pub(super) fn into_fd(socket: std::net::TcpStream) -> i32 {
    use std::os::fd::IntoRawFd;
    socket.into_raw_fd()
}
