//! The PyO3 seam of the native governed routes: `NativeRoutes(runtime, relay, ...)`, given to
//! a `Front` with `set_native`, and `take()`, which hands Python what it must carry out and
//! the records it has work with (see `gateway/native.py`).

use std::fs::File;
use std::os::fd::FromRawFd;
use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::actions::action_to_py;
use super::errors::InvalidArgumentError;
use super::front::PyFront;
use super::front_checks::{PyFrontChecks, PyFrontKeys};
use super::relay::PyRelay;
use super::runtime::PyRuntime;
use super::tally::PyTally;
use crate::front::governed::{BackendRoute, Governed};
use crate::front::owner::Owner;
use crate::front::record::Record;
use crate::front::traceparent::{TraceIds, Tracing};
use crate::hosted::Hosted;
use crate::relay::upstream::{ClientIdentity, Tls};

/// A backend as the native routes get it: (name, url, priority_scheduling, tls_ca_file,
/// tls_client_cert, tls_client_key).
type Backend = (
    String,
    String,
    bool,
    Option<PathBuf>,
    Option<PathBuf>,
    Option<PathBuf>,
);

/// The governed completions served in Rust, against the runtime Python feeds too.
#[pyclass(name = "NativeRoutes", module = "llmflow._core", frozen)]
pub struct PyNativeRoutes {
    governed: Arc<Governed>,
}

#[pymethods]
impl PyNativeRoutes {
    /// `backends`: (name, url, priority_scheduling, tls_ca_file, tls_client_cert,
    /// tls_client_key) in the runtime's backend order;
    /// `notify_fd`: the write end of the pipe that wakes Python for `take()`;
    /// `tally`: where the front counts its requests and writes their access-log rows;
    /// `sample_ratio`: telemetry's, None while telemetry is off.
    #[new]
    #[pyo3(signature = (
        runtime, relay, notify_fd, checks, keys, backends, *, tally, own_hosts=None,
        write_timeout_ms=60_000.0, sample_ratio=None
    ))]
    #[allow(clippy::too_many_arguments)] // the gateway's parts, one for one
    fn new(
        runtime: &Bound<'_, PyRuntime>,
        relay: &Bound<'_, PyRelay>,
        notify_fd: i32,
        checks: &Bound<'_, PyFrontChecks>,
        keys: &Bound<'_, PyFrontKeys>,
        backends: Vec<Backend>,
        tally: &Bound<'_, PyTally>,
        own_hosts: Option<Vec<String>>,
        write_timeout_ms: f64,
        sample_ratio: Option<f64>,
    ) -> PyResult<Self> {
        if !(write_timeout_ms.is_finite() && write_timeout_ms > 0.0) {
            return Err(InvalidArgumentError::new_err(format!(
                "write_timeout_ms must be a finite number above 0, got {write_timeout_ms}"
            )));
        }
        if let Some(ratio) = sample_ratio.filter(|r| !(0.0..=1.0).contains(r)) {
            return Err(InvalidArgumentError::new_err(format!(
                "sample_ratio must be a number from 0 to 1, got {ratio}"
            )));
        }
        if notify_fd < 0 {
            return Err(InvalidArgumentError::new_err(format!(
                "notify_fd must be a pipe's write end, got {notify_fd}"
            )));
        }
        let shared = runtime.borrow().shared();
        {
            let hosted = Hosted::lock(&shared);
            let names: Vec<&str> = (0..backends.len() as u32)
                .map(|b| hosted.runtime().governor().backend_name(b))
                .collect();
            let given: Vec<&str> = backends.iter().map(|(n, ..)| n.as_str()).collect();
            if names != given {
                return Err(InvalidArgumentError::new_err(format!(
                    "backends must be the runtime's, in its order: {names:?}, got {given:?}"
                )));
            }
            if hosted.is_shared() {
                return Err(InvalidArgumentError::new_err(
                    "this runtime already has native routes",
                ));
            }
        }
        let backends = backends
            .into_iter()
            .map(
                |(name, url, priority_scheduling, ca_file, cert_file, key_file)| {
                    let client = cert_file
                        .map(|cert| ClientIdentity::from_files(&cert, key_file.as_deref()))
                        .transpose()
                        .map_err(InvalidArgumentError::new_err)?;
                    let tls = Tls::for_backend(ca_file.as_deref(), client)
                        .map_err(InvalidArgumentError::new_err)?;
                    Ok(BackendRoute {
                        name,
                        url,
                        tls,
                        priority_scheduling,
                    })
                },
            )
            .collect::<PyResult<Vec<_>>>()?;
        let streams = relay.borrow().inner.streams().clone();
        // SAFETY: the caller hands over the pipe's write end; the owner writes and closes it.
        let notify = unsafe { File::from_raw_fd(notify_fd) };
        let owner = Owner::attach(
            shared,
            streams.clone(),
            notify,
            Arc::clone(&tally.get().inner),
        );
        let governed = Governed {
            owner,
            streams,
            checks: checks.get().config.clone(),
            keys: keys.get().inner.clone(),
            backends,
            own_hosts: own_hosts.map(|h| h.into_iter().map(|n| n.to_lowercase()).collect()),
            write_timeout: std::time::Duration::from_secs_f64(write_timeout_ms / 1e3),
            tracing: sample_ratio.map(Tracing::new),
        };
        Ok(Self {
            governed: Arc::new(governed),
        })
    }

    /// Serve the governed routes of `front` natively from now on.
    fn serve_on(&self, front: &Bound<'_, PyFront>) {
        front.borrow().set_native(Arc::clone(&self.governed) as _);
    }

    /// (actions of Python's requests that a native request's event caused, the end records
    /// of the native requests Python has work with: spans, a warning), each oldest first;
    /// empties the inbox.
    fn take<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyList>, Bound<'py, PyList>)> {
        let owner = &self.governed.owner;
        let (actions, records) = py.detach(|| owner.take());
        let out = PyList::empty(py);
        if !actions.is_empty() {
            let hosted = Hosted::lock(owner.runtime());
            for action in &actions {
                out.append(action_to_py(py, hosted.runtime().governor(), action)?)?;
            }
        }
        let rows = PyList::empty(py);
        for record in &records {
            rows.append(record_to_py(py, record)?)?;
        }
        Ok((out, rows))
    }

    /// The requests the front serves now, as dicts (`id`, `tenant`, `tier`, `arrived_us`,
    /// `backend`, `streaming`), oldest first.
    fn streams<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for (id, live) in self.governed.owner.streams() {
            let d = PyDict::new(py);
            d.set_item("id", id)?;
            d.set_item("tenant", &live.tenant)?;
            d.set_item("tier", &live.tier)?;
            d.set_item("arrived_us", live.arrived_us)?;
            d.set_item("backend", &live.backend)?;
            d.set_item("streaming", live.streaming)?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// Requests the front serves now (arrived and not yet ended).
    #[getter]
    fn live(&self) -> usize {
        self.governed.owner.live()
    }
}

fn record_to_py<'py>(py: Python<'py>, r: &Record) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("id", r.id)?;
    d.set_item("tenant", &r.tenant)?;
    d.set_item("tier", &r.tier)?;
    d.set_item("arrived_us", r.arrived_us)?;
    d.set_item("started_us", r.started_us)?;
    d.set_item("first_token_us", r.first_token_us)?;
    d.set_item("ended_us", r.ended_us)?;
    d.set_item("prompt_tokens", r.prompt_tokens)?;
    d.set_item("max_tokens", r.max_tokens)?;
    d.set_item("completion_tokens", r.completion_tokens)?;
    d.set_item("end", &r.end)?;
    d.set_item("error", r.error.as_ref().map(|(s, c)| (*s, c.as_str())))?;
    d.set_item("retry_after_s", r.retry_after_s)?;
    d.set_item("refused", r.refused)?;
    d.set_item("truncated", r.truncated)?;
    d.set_item("upstream_aborted", r.upstream_aborted)?;
    d.set_item("backend", &r.backend)?;
    d.set_item("prefill_unread", &r.prefill_unread)?;
    d.set_item("path", r.path)?;
    d.set_item("stream", r.stream)?;
    d.set_item("model", &r.model)?;
    d.set_item("queue_wait_us", r.queue_wait_us)?;
    d.set_item("brownout_max_tokens", r.brownout_max_tokens)?;
    match &r.trace {
        Some(trace) => d.set_item("trace", trace_to_py(py, trace)?)?,
        None => d.set_item("trace", py.None())?,
    }
    d.set_item(
        "shadow",
        r.shadow.clone().map(super::runtime::verdict_tuple),
    )?;
    Ok(d)
}

/// A request's trace, as `telemetry.NativeTrace` takes it.
fn trace_to_py<'py>(py: Python<'py>, t: &TraceIds) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("trace_id", t.trace_id)?;
    d.set_item("span_id", t.span_id)?;
    d.set_item("queue_span_id", t.queue_span_id)?;
    d.set_item("upstream_span_id", t.upstream_span_id)?;
    d.set_item("parent_span_id", t.parent.map(|p| p.span_id))?;
    d.set_item("parent_flags", t.parent.map_or(0, |p| p.flags))?;
    d.set_item("flags", t.flags)?;
    Ok(d)
}
