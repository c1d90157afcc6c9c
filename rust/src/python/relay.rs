//! The PyO3 seam of the relay: open, attach, cut, abort, close; events as tuples.
//!
//! Events are plain tuples (`("done", id)`, ...) because the host reads a batch of them per
//! wake-up and dispatches on the first item; a class per event would cost more than it says.

use std::fs::File;
use std::os::fd::FromRawFd;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use pyo3::{intern, IntoPyObjectExt};

use super::errors::InvalidArgumentError;
use super::signature::Signature;
use crate::relay::{
    Control, Relay, RelayConfig, RelayEvent, StreamRequest, DEFAULT_MAX_EVENT_BYTES, GAP_BOUNDS_S,
};

/// The longest the host waits for a stream to carry out a cut, an abort or a close: the
/// upstream socket is closed before the runtime's next `Start` goes out (a stream busy for
/// longer is closed a moment later all the same).
const CARRY_OUT_WAIT: Duration = Duration::from_millis(100);

/// Relays streamed completions from vLLM to clients on threads of its own.
#[pyclass(name = "Relay", module = "llmflow._core")]
pub struct PyRelay {
    pub(super) inner: Relay,
}

fn duration_ms(name: &str, ms: f64) -> PyResult<Duration> {
    if !ms.is_finite() || ms < 0.0 {
        return Err(InvalidArgumentError::new_err(format!(
            "{name} must be a finite number of milliseconds >= 0, got {ms}"
        )));
    }
    Ok(Duration::from_secs_f64(ms / 1e3))
}

#[pymethods]
impl PyRelay {
    #[new]
    #[pyo3(signature = (*args, **kwargs), text_signature = "(notify_fd, *, threads=1, \
        client_window=8, pause_when_full=True, flush_interval_ms=0.0, token_flush_ms=20.0, \
        connect_timeout_ms=5000.0, max_event_bytes=16777216)")]
    fn new(args: &Bound<'_, PyTuple>, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        const NEW: Signature = Signature {
            full_name: "Relay.__new__()",
            positional: &["notify_fd"],
            optional: 0,
            keyword_only: &[
                "threads",
                "client_window",
                "pause_when_full",
                "flush_interval_ms",
                "token_flush_ms",
                "connect_timeout_ms",
                "max_event_bytes",
            ],
        };
        let a = NEW.bind(args, kwargs)?;
        let notify_fd: i32 = a.get(0)?;
        let (threads, client_window): (usize, usize) = (a.get_or(1, 1)?, a.get_or(2, 8)?);
        let pause_when_full: bool = a.get_or(3, true)?;
        let flush_interval_ms: f64 = a.get_or(4, 0.0)?;
        let token_flush_ms: f64 = a.get_or(5, 20.0)?;
        let connect_timeout_ms: f64 = a.get_or(6, 5000.0)?;
        let max_event_bytes: usize = a.get_or(7, DEFAULT_MAX_EVENT_BYTES)?;
        if threads == 0 || client_window == 0 {
            return Err(InvalidArgumentError::new_err(
                "threads and client_window must be at least 1",
            ));
        }
        let token_flush = duration_ms("token_flush_ms", token_flush_ms)?;
        if token_flush.is_zero() {
            return Err(InvalidArgumentError::new_err("token_flush_ms must be > 0"));
        }
        let config = RelayConfig {
            threads,
            client_window,
            pause_when_full,
            flush_interval: duration_ms("flush_interval_ms", flush_interval_ms)?,
            token_flush,
            connect_timeout: duration_ms("connect_timeout_ms", connect_timeout_ms)?,
            max_event_bytes,
        };
        // SAFETY: the caller hands over the write end of its wake-up pipe; the relay owns it.
        let notify = unsafe { File::from_raw_fd(notify_fd) };
        let inner = Relay::new(config, notify)
            .map_err(|e| pyo3::exceptions::PyOSError::new_err(e.to_string()))?;
        Ok(Self { inner })
    }

    /// Send a streamed completion to `url` and relay it; the client attaches later. With
    /// `deferred`, the stream exists at once (controls apply) but waits for `go` to send.
    /// `traceparent` goes upstream as W3C `traceparent` (OpenTelemetry), beside `X-Request-Id`.
    #[pyo3(signature = (*args, **kwargs), text_signature = "($self, request_id, url, body, \
        x_request_id, include_usage, deferred=False, traceparent=None)")]
    fn open(&self, args: &Bound<'_, PyTuple>, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<()> {
        const OPEN: Signature = Signature {
            full_name: "Relay.open()",
            positional: &[
                "request_id",
                "url",
                "body",
                "x_request_id",
                "include_usage",
                "deferred",
                "traceparent",
            ],
            optional: 2,
            keyword_only: &[],
        };
        let a = OPEN.bind(args, kwargs)?;
        let (id, url, body): (u64, &str, &[u8]) = (a.get(0)?, a.get(1)?, a.get(2)?);
        let (request_id, include_usage): (&str, bool) = (a.get(3)?, a.get(4)?);
        let deferred: bool = a.get_or(5, false)?;
        let traceparent: Option<&str> = a.get_or(6, None)?;
        let request = StreamRequest {
            id,
            url,
            body: body.to_vec(),
            request_id,
            traceparent,
            include_usage,
            deferred,
            sink: None,
        };
        self.inner
            .open(request)
            .map_err(InvalidArgumentError::new_err)
    }

    /// Send a deferred stream's request upstream now.
    fn go(&self, request_id: u64) -> bool {
        self.inner.control(request_id, Control::Go)
    }

    /// Give the stream the client's socket (the relay owns `fd` from now on, and closes it
    /// if the stream is gone). Returns False when the stream had already ended.
    fn attach(&self, request_id: u64, fd: i32, head: &[u8], keep_alive: bool) -> bool {
        // SAFETY: the caller hands over a connected TCP socket it no longer uses.
        let socket = unsafe { std::net::TcpStream::from_raw_fd(fd) };
        self.inner.control(
            request_id,
            Control::Attach {
                socket,
                head: head.to_vec(),
                keep_alive,
            },
        )
    }

    /// End the reply with `frame` (then `[DONE]`), or close the connection now (`None`).
    #[pyo3(signature = (request_id, frame, only_if_open=false))]
    fn cut(
        &self,
        py: Python<'_>,
        request_id: u64,
        frame: Option<&[u8]>,
        only_if_open: bool,
    ) -> bool {
        let control = Control::Cut {
            frame: frame.map(<[u8]>::to_vec),
            only_if_open,
        };
        py.detach(|| {
            self.inner
                .control_and_wait(request_id, control, CARRY_OUT_WAIT)
        })
    }

    /// Close the upstream request (vLLM aborts it); returns once the socket is closed.
    fn abort(&self, py: Python<'_>, request_id: u64) -> bool {
        py.detach(|| {
            self.inner
                .control_and_wait(request_id, Control::Abort, CARRY_OUT_WAIT)
        })
    }

    /// Drop the stream now, upstream and client; returns once it is done.
    fn close(&self, py: Python<'_>, request_id: u64) -> bool {
        py.detach(|| {
            self.inner
                .control_and_wait(request_id, Control::Close, CARRY_OUT_WAIT)
        })
    }

    /// Stop every stream and the relay's threads (the relay is unusable afterwards).
    fn shutdown(&mut self) {
        self.inner.shutdown();
    }

    /// Streams still running.
    #[getter]
    fn live(&self) -> usize {
        self.inner.live()
    }

    /// Every event since the last call, oldest first, as tuples.
    fn events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for event in self.inner.take_events() {
            let item: Bound<'py, PyTuple> = match event {
                RelayEvent::Started(id) => (intern!(py, "started"), id).into_pyobject(py)?,
                RelayEvent::FirstToken { id, n, template } => {
                    (intern!(py, "first_token"), id, n, template).into_pyobject(py)?
                }
                RelayEvent::Tokens(batch) => (intern!(py, "tokens"), batch).into_pyobject(py)?,
                RelayEvent::Done(id) => (intern!(py, "done"), id).into_pyobject(py)?,
                RelayEvent::Failed(id, f) => (
                    intern!(py, "failed"),
                    id,
                    f.status,
                    f.code,
                    f.message,
                    f.backend_down,
                    f.error,
                )
                    .into_pyobject(py)?,
                RelayEvent::WindowFull(id) => (intern!(py, "window_full"), id).into_pyobject(py)?,
                RelayEvent::WindowDrained(id) => {
                    (intern!(py, "window_drained"), id).into_pyobject(py)?
                }
                RelayEvent::ClientGone(id) => (intern!(py, "client_gone"), id).into_pyobject(py)?,
                RelayEvent::Closed {
                    id,
                    socket,
                    upstream_complete,
                    completion_tokens,
                } => (
                    intern!(py, "closed"),
                    id,
                    socket,
                    upstream_complete,
                    completion_tokens,
                )
                    .into_pyobject(py)?,
            };
            list.append(item)?;
        }
        Ok(list)
    }

    /// Gaps between writes to clients: (bucket upper bounds in s, per-bucket counts with the
    /// last for +Inf, sum in s).
    fn inter_chunk<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let (counts, sum) = self.inner.stats().gaps();
        (GAP_BOUNDS_S.to_vec(), counts, sum).into_bound_py_any(py)
    }

    fn __repr__(&self) -> String {
        format!("Relay(live={})", self.inner.live())
    }
}
