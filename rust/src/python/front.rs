//! The PyO3 seam of the front door: `Front(relay, listen_fd, app_socket, ...)` and `close()`.

use std::os::fd::FromRawFd;
use std::path::PathBuf;
use std::time::Duration;

use pyo3::prelude::*;

use super::errors::InvalidArgumentError;
use super::relay::PyRelay;
use crate::front::http::KEEP_ALIVE;
use crate::front::{Front, Limits};

/// The public listener and every client connection, served on the relay's threads.
#[pyclass(name = "Front", module = "llmflow._core")]
pub struct PyFront {
    /// The seam the native server plugs into (`Front::set_native`).
    pub(super) inner: Front,
}

fn duration_ms(name: &str, ms: f64) -> PyResult<Duration> {
    if !ms.is_finite() || ms <= 0.0 {
        return Err(InvalidArgumentError::new_err(format!(
            "{name} must be a finite number of milliseconds > 0, got {ms}"
        )));
    }
    Ok(Duration::from_secs_f64(ms / 1e3))
}

#[pymethods]
impl PyFront {
    #[new]
    #[pyo3(signature = (relay, listen_fd, app_socket, *, max_header_bytes, max_body_bytes,
        read_timeout_ms=30000.0, write_timeout_ms=60000.0))]
    fn new(
        relay: &Bound<'_, PyRelay>,
        listen_fd: i32,
        app_socket: PathBuf,
        max_header_bytes: usize,
        max_body_bytes: usize,
        read_timeout_ms: f64,
        write_timeout_ms: f64,
    ) -> PyResult<Self> {
        let limits = Limits {
            max_header_bytes,
            max_body_bytes,
            read_timeout: duration_ms("read_timeout_ms", read_timeout_ms)?,
            keep_alive_timeout: KEEP_ALIVE,
            write_timeout: duration_ms("write_timeout_ms", write_timeout_ms)?,
        };
        let Some(runtime) = relay.borrow().inner.handle() else {
            return Err(InvalidArgumentError::new_err("the relay has shut down"));
        };
        if listen_fd < 0 {
            return Err(InvalidArgumentError::new_err(format!(
                "listen_fd must be a listening socket's fd, got {listen_fd}"
            )));
        }
        // SAFETY: the caller hands over a bound, listening TCP socket; the front owns it now.
        let listener = unsafe { std::net::TcpListener::from_raw_fd(listen_fd) };
        let inner = Front::start(&runtime, listener, app_socket, limits)
            .map_err(|e| pyo3::exceptions::PyOSError::new_err(e.to_string()))?;
        Ok(Self { inner })
    }

    /// Requests passed to the app whose reply is still being written to its client (a
    /// WebSocket counts for its whole life): a shutdown waits for them before `close`.
    #[getter]
    fn passing(&self) -> usize {
        self.inner.passing()
    }

    /// Stop accepting and drop every connection.
    fn close(&self) {
        self.inner.close();
    }
}

impl PyFront {
    /// Serve the governed routes with `native` from now on (`NativeRoutes.serve_on`).
    pub(super) fn set_native(&self, native: std::sync::Arc<dyn crate::front::Native>) {
        self.inner.set_native(native);
    }
}
