//! The PyO3 seam of the relay: built by the gateway for the front door to run on (its streams
//! are the front's: Python opens none), and its write-gap histogram for `/metrics`.

use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use pyo3::IntoPyObjectExt;

use super::errors::InvalidArgumentError;
use super::signature::Signature;
use crate::relay::{Relay, RelayConfig, DEFAULT_MAX_EVENT_BYTES, GAP_BOUNDS_S};

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
    #[pyo3(signature = (*args, **kwargs), text_signature = "(*, threads=1, \
        client_window=8, pause_when_full=True, flush_interval_ms=0.0, token_flush_ms=20.0, \
        connect_timeout_ms=5000.0, max_event_bytes=16777216)")]
    fn new(args: &Bound<'_, PyTuple>, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        const NEW: Signature = Signature {
            full_name: "Relay.__new__()",
            positional: &[],
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
        let (threads, client_window): (usize, usize) = (a.get_or(0, 1)?, a.get_or(1, 8)?);
        let pause_when_full: bool = a.get_or(2, true)?;
        let flush_interval_ms: f64 = a.get_or(3, 0.0)?;
        let token_flush_ms: f64 = a.get_or(4, 20.0)?;
        let connect_timeout_ms: f64 = a.get_or(5, 5000.0)?;
        let max_event_bytes: usize = a.get_or(6, DEFAULT_MAX_EVENT_BYTES)?;
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
        let inner =
            Relay::new(config).map_err(|e| pyo3::exceptions::PyOSError::new_err(e.to_string()))?;
        Ok(Self { inner })
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
