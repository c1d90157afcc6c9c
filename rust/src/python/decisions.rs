//! The governor's answers as small frozen classes: `Admitted`, `Queued`, `Rejected` (what
//! `submit` decides), `Admission` (what `dispatch` starts) and `Expired` (a missed deadline).

use pyo3::prelude::*;

use super::errors::InvalidArgumentError;
use crate::types::RejectReason;

/// `Governor.submit` admitted the request: it holds a slot on `backend`.
#[pyclass(name = "Admitted", module = "llmflow._core", frozen, get_all, eq)]
#[derive(PartialEq)]
pub struct PyAdmitted {
    pub(super) request_id: u64,
    pub(super) backend: String,
    pub(super) priority: i64,
    /// In a split pool: the prefill instance the request goes to first.
    pub(super) prefill_backend: Option<String>,
}

#[pymethods]
impl PyAdmitted {
    #[new]
    #[pyo3(signature = (request_id, backend, priority, prefill_backend=None))]
    fn new(
        request_id: u64,
        backend: String,
        priority: i64,
        prefill_backend: Option<String>,
    ) -> Self {
        Self {
            request_id,
            backend,
            priority,
            prefill_backend,
        }
    }

    #[classattr]
    fn __match_args__() -> (&'static str, &'static str, &'static str) {
        ("request_id", "backend", "priority")
    }

    fn __repr__(&self) -> String {
        let prefill = self
            .prefill_backend
            .as_ref()
            .map_or_else(String::new, |p| format!(", prefill_backend='{p}'"));
        format!(
            "Admitted(request_id={}, backend='{}', priority={}{prefill})",
            self.request_id, self.backend, self.priority
        )
    }
}

/// `Governor.submit` queued the request (and may have pushed out another one).
#[pyclass(name = "Queued", module = "llmflow._core", frozen, get_all, eq)]
#[derive(PartialEq)]
pub struct PyQueued {
    pub(super) request_id: u64,
    pub(super) position: u32,
    pub(super) estimated_wait_s: f64,
    pub(super) priority: i64,
    pub(super) displaced: Option<u64>,
    pub(super) displaced_retry_after_s: Option<f64>,
}

#[pymethods]
impl PyQueued {
    #[new]
    #[pyo3(signature = (request_id, position, estimated_wait_s, priority, displaced=None,
                        displaced_retry_after_s=None))]
    fn new(
        request_id: u64,
        position: u32,
        estimated_wait_s: f64,
        priority: i64,
        displaced: Option<u64>,
        displaced_retry_after_s: Option<f64>,
    ) -> Self {
        Self {
            request_id,
            position,
            estimated_wait_s,
            priority,
            displaced,
            displaced_retry_after_s,
        }
    }

    #[classattr]
    fn __match_args__() -> (
        &'static str,
        &'static str,
        &'static str,
        &'static str,
        &'static str,
        &'static str,
    ) {
        (
            "request_id",
            "position",
            "estimated_wait_s",
            "priority",
            "displaced",
            "displaced_retry_after_s",
        )
    }

    fn __repr__(&self) -> String {
        format!(
            "Queued(request_id={}, position={}, estimated_wait_s={:?}, priority={}, \
             displaced={}, displaced_retry_after_s={})",
            self.request_id,
            self.position,
            self.estimated_wait_s,
            self.priority,
            py_repr(self.displaced),
            py_repr(self.displaced_retry_after_s),
        )
    }
}

/// `Governor.submit` refused the request: a 429 (503 while draining) with a Retry-After.
#[pyclass(name = "Rejected", module = "llmflow._core", frozen, get_all, eq)]
#[derive(PartialEq)]
pub struct PyRejected {
    pub(super) request_id: u64,
    pub(super) reason: &'static str,
    pub(super) retry_after_s: f64,
}

#[pymethods]
impl PyRejected {
    #[new]
    fn new(request_id: u64, reason: &str, retry_after_s: f64) -> PyResult<Self> {
        let reason = RejectReason::ALL
            .into_iter()
            .map(RejectReason::as_str)
            .find(|&r| r == reason)
            .ok_or_else(|| {
                InvalidArgumentError::new_err(format!("unknown reject reason {reason:?}"))
            })?;
        Ok(Self {
            request_id,
            reason,
            retry_after_s,
        })
    }

    #[classattr]
    fn __match_args__() -> (&'static str, &'static str, &'static str) {
        ("request_id", "reason", "retry_after_s")
    }

    fn __repr__(&self) -> String {
        format!(
            "Rejected(request_id={}, reason='{}', retry_after_s={:?})",
            self.request_id, self.reason, self.retry_after_s
        )
    }
}

/// Python's repr of an optional number: `None` or the number.
fn py_repr<T: std::fmt::Debug>(value: Option<T>) -> String {
    value.map_or_else(|| "None".to_owned(), |v| format!("{v:?}"))
}

#[pyclass(name = "Admission", module = "llmflow._core", frozen, get_all)]
pub struct PyAdmission {
    pub(super) request_id: u64,
    pub(super) backend: String,
    pub(super) priority: i64,
    pub(super) queue_wait_s: f64,
    /// In a split pool: the prefill instance the request goes to first.
    pub(super) prefill_backend: Option<String>,
}

#[pymethods]
impl PyAdmission {
    fn __repr__(&self) -> String {
        format!(
            "Admission(request_id={}, backend={:?})",
            self.request_id, self.backend
        )
    }
}

#[pyclass(name = "Expired", module = "llmflow._core", frozen, get_all)]
pub struct PyExpired {
    pub(super) request_id: u64,
    pub(super) reason: &'static str,
    pub(super) was_running: bool,
    pub(super) backend: Option<String>,
    pub(super) retry_after_s: f64,
}

#[pymethods]
impl PyExpired {
    fn __repr__(&self) -> String {
        format!(
            "Expired(request_id={}, reason={:?})",
            self.request_id, self.reason
        )
    }
}
