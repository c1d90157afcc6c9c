//! The runtime's actions as small frozen classes, one per kind: hosts dispatch on
//! `type(action)`. Each carries names (backends) rather than the core's indexes.

use pyo3::prelude::*;

use crate::runtime::Action;
use crate::Governor;

/// Send the request upstream.
#[pyclass(name = "Start", module = "llmflow._core", frozen, get_all)]
pub struct PyStart {
    request_id: u64,
    backend: String,
    priority: i64,
    queue_wait_s: f64,
    max_tokens: Option<u64>,
    /// In a split pool: the prefill instance the request goes to first, and the vLLM
    /// priority of that hop.
    prefill_backend: Option<String>,
    prefill_priority: Option<i64>,
}

/// The request waits in the gateway's queue.
#[pyclass(name = "Wait", module = "llmflow._core", frozen, get_all)]
pub struct PyWait {
    request_id: u64,
    position: u32,
    estimated_wait_s: f64,
}

/// Close the upstream request now (vLLM aborts it and frees its KV).
#[pyclass(name = "Abort", module = "llmflow._core", frozen, get_all)]
pub struct PyAbort {
    request_id: u64,
}

/// Terminal: answer with this status and Retry-After.
#[pyclass(name = "Reply", module = "llmflow._core", frozen, get_all)]
pub struct PyReply {
    request_id: u64,
    status: u16,
    reason: &'static str,
    retry_after_s: Option<u32>,
}

/// Terminal: end the reply now with its partial text and a visible notice.
#[pyclass(name = "Cut", module = "llmflow._core", frozen, get_all)]
pub struct PyCut {
    request_id: u64,
    reason: &'static str,
}

/// Terminal: the request is over.
#[pyclass(name = "End", module = "llmflow._core", frozen, get_all)]
pub struct PyEnd {
    request_id: u64,
    outcome: &'static str,
}

/// (Re)set the host's one timer.
#[pyclass(name = "Arm", module = "llmflow._core", frozen, get_all)]
pub struct PyArm {
    at_us: u64,
}

/// A backend went down or came back.
#[pyclass(name = "SetHealth", module = "llmflow._core", frozen, get_all)]
pub struct PySetHealth {
    backend: String,
    healthy: bool,
}

/// Ask the shared store for a lease on one of the backend's slots, below `cap`.
#[pyclass(name = "Lease", module = "llmflow._core", frozen, get_all)]
pub struct PyLease {
    request_id: u64,
    backend: String,
    cap: u32,
}

/// Give the request's lease back to the shared store.
#[pyclass(name = "Release", module = "llmflow._core", frozen, get_all)]
pub struct PyRelease {
    request_id: u64,
    backend: String,
}

/// Python's spelling of a value, for `__repr__`.
trait PyRepr {
    fn py_repr(&self) -> String;
}

impl PyRepr for u64 {
    fn py_repr(&self) -> String {
        self.to_string()
    }
}
impl PyRepr for u32 {
    fn py_repr(&self) -> String {
        self.to_string()
    }
}
impl PyRepr for u16 {
    fn py_repr(&self) -> String {
        self.to_string()
    }
}
impl PyRepr for i64 {
    fn py_repr(&self) -> String {
        self.to_string()
    }
}
impl PyRepr for f64 {
    fn py_repr(&self) -> String {
        format!("{self:?}") // always with a decimal point, as Python prints floats
    }
}
impl PyRepr for bool {
    fn py_repr(&self) -> String {
        (if *self { "True" } else { "False" }).to_owned()
    }
}
impl PyRepr for &str {
    fn py_repr(&self) -> String {
        format!("'{self}'")
    }
}
impl PyRepr for String {
    fn py_repr(&self) -> String {
        self.as_str().py_repr()
    }
}
impl<T: PyRepr> PyRepr for Option<T> {
    fn py_repr(&self) -> String {
        self.as_ref()
            .map_or_else(|| "None".to_owned(), PyRepr::py_repr)
    }
}

macro_rules! reprs {
    ($($ty:ident => $name:literal: $($field:ident),*;)*) => {$(
        #[pymethods]
        impl $ty {
            fn __repr__(&self) -> String {
                let fields: Vec<String> = vec![
                    $(format!("{}={}", stringify!($field), self.$field.py_repr())),*
                ];
                format!("{}({})", $name, fields.join(", "))
            }
        }
    )*};
}

reprs! {
    PyStart => "Start": request_id, backend, priority, queue_wait_s, max_tokens, prefill_backend,
        prefill_priority;
    PyWait => "Wait": request_id, position, estimated_wait_s;
    PyAbort => "Abort": request_id;
    PyReply => "Reply": request_id, status, reason, retry_after_s;
    PyCut => "Cut": request_id, reason;
    PyEnd => "End": request_id, outcome;
    PyArm => "Arm": at_us;
    PySetHealth => "SetHealth": backend, healthy;
    PyLease => "Lease": request_id, backend, cap;
    PyRelease => "Release": request_id, backend;
}

/// One action as its Python class.
pub(super) fn action_to_py(py: Python<'_>, gov: &Governor, action: &Action) -> PyResult<Py<PyAny>> {
    Ok(match *action {
        Action::Start {
            id,
            backend,
            priority,
            queue_wait_us,
            max_tokens,
            prefill,
        } => Py::new(
            py,
            PyStart {
                request_id: id,
                backend: gov.backend_name(backend).to_owned(),
                priority,
                queue_wait_s: queue_wait_us as f64 / 1e6,
                max_tokens,
                prefill_backend: prefill.map(|p| gov.backend_name(p.backend).to_owned()),
                prefill_priority: prefill.map(|p| p.priority),
            },
        )?
        .into_any(),
        Action::Queued {
            id,
            position,
            estimated_wait_s,
        } => Py::new(
            py,
            PyWait {
                request_id: id,
                position,
                estimated_wait_s,
            },
        )?
        .into_any(),
        Action::Abort { id } => Py::new(py, PyAbort { request_id: id })?.into_any(),
        Action::Reply {
            id,
            status,
            reason,
            retry_after_s,
        } => Py::new(
            py,
            PyReply {
                request_id: id,
                status,
                reason: reason.as_str(),
                retry_after_s,
            },
        )?
        .into_any(),
        Action::Cut { id, reason } => Py::new(
            py,
            PyCut {
                request_id: id,
                reason: reason.as_str(),
            },
        )?
        .into_any(),
        Action::End { id, outcome } => Py::new(
            py,
            PyEnd {
                request_id: id,
                outcome: outcome.as_str(),
            },
        )?
        .into_any(),
        Action::Arm { at_us } => Py::new(py, PyArm { at_us })?.into_any(),
        Action::Backend { backend, healthy } => Py::new(
            py,
            PySetHealth {
                backend: gov.backend_name(backend).to_owned(),
                healthy,
            },
        )?
        .into_any(),
        Action::Lease { id, backend, cap } => Py::new(
            py,
            PyLease {
                request_id: id,
                backend: gov.backend_name(backend).to_owned(),
                cap,
            },
        )?
        .into_any(),
        Action::Release { id, backend } => Py::new(
            py,
            PyRelease {
                request_id: id,
                backend: gov.backend_name(backend).to_owned(),
            },
        )?
        .into_any(),
    })
}
