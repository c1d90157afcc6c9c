//! The PyO3 seam: thin wrappers that convert arguments and delegate to the domain types.
//!
//! Per-request calls take microseconds and keep the GIL; only construction parses JSON.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyList, PyString};
use serde_json::Value;

use crate::capacity;
use crate::error::PolicyError as CoreError;
use crate::governor::{Arrival, Governor, Route};
use crate::types::{Admission, Decision, Expired, Outcome, RejectReason};

create_exception!(
    llmflow._core,
    PolicyError,
    PyException,
    "Base class of every core error."
);
create_exception!(
    llmflow._core,
    ConfigError,
    PolicyError,
    "A policy config value is wrong."
);
create_exception!(
    llmflow._core,
    UnknownTenantError,
    PolicyError,
    "Unknown tenant."
);
create_exception!(
    llmflow._core,
    UnknownBackendError,
    PolicyError,
    "Unknown backend."
);
create_exception!(
    llmflow._core,
    UnknownModelError,
    PolicyError,
    "No backend serves the model a request names (or none named where several are served)."
);
create_exception!(
    llmflow._core,
    DuplicateRequestError,
    PolicyError,
    "Request id still live."
);
create_exception!(
    llmflow._core,
    TraceMismatchError,
    PolicyError,
    "A replayed trace's actions differ from the recorded ones."
);
create_exception!(
    llmflow._core,
    InvalidArgumentError,
    PolicyError,
    "Argument out of range."
);

impl From<CoreError> for PyErr {
    fn from(err: CoreError) -> PyErr {
        let message = err.to_string();
        match err {
            CoreError::Config { .. } => ConfigError::new_err(message),
            CoreError::UnknownTenant(_) => UnknownTenantError::new_err(message),
            CoreError::UnknownBackend(_) => UnknownBackendError::new_err(message),
            CoreError::UnknownModel(..) | CoreError::ModelRequired(_) => {
                UnknownModelError::new_err(message)
            }
            CoreError::DuplicateRequest(_) => DuplicateRequestError::new_err(message),
            CoreError::InvalidArgument(_) => InvalidArgumentError::new_err(message),
        }
    }
}

#[cold]
fn negative(name: &str, value: i64) -> PyErr {
    InvalidArgumentError::new_err(format!("{name} must be >= 0, got {value}"))
}

pub(crate) fn non_negative(name: &str, value: i64) -> PyResult<u64> {
    u64::try_from(value).map_err(|_| negative(name, value))
}

/// `Governor.submit` admitted the request: it holds a slot on `backend`.
#[pyclass(name = "Admitted", module = "llmflow._core", frozen, get_all, eq)]
#[derive(PartialEq)]
pub struct PyAdmitted {
    request_id: u64,
    backend: String,
    priority: i64,
    /// In a split pool: the prefill instance the request goes to first.
    prefill_backend: Option<String>,
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
    request_id: u64,
    position: u32,
    estimated_wait_s: f64,
    priority: i64,
    displaced: Option<u64>,
    displaced_retry_after_s: Option<f64>,
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
    request_id: u64,
    reason: &'static str,
    retry_after_s: f64,
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
    request_id: u64,
    backend: String,
    priority: i64,
    queue_wait_s: f64,
    /// In a split pool: the prefill instance the request goes to first.
    prefill_backend: Option<String>,
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
    request_id: u64,
    reason: &'static str,
    was_running: bool,
    backend: Option<String>,
    retry_after_s: f64,
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

/// One governor per event loop (or simulation): the GIL serialises access to it.
#[pyclass(name = "Governor", module = "llmflow._core")]
pub struct PyGovernor {
    inner: Governor,
}

impl PyGovernor {
    fn backend_name(&self, backend: u32) -> String {
        self.inner.backend_name(backend).to_owned()
    }
}

#[pymethods]
impl PyGovernor {
    #[new]
    fn new(py: Python<'_>, config: &Bound<'_, PyAny>) -> PyResult<Self> {
        if !config.is_instance_of::<PyDict>() {
            return Err(ConfigError::new_err(format!(
                "config must be a mapping (dict), got {}",
                config.get_type().name()?
            )));
        }
        let json = py.import("json")?.call_method1("dumps", (config,))?;
        Ok(Self {
            inner: Governor::from_json(json.extract::<&str>()?)?,
        })
    }

    #[allow(clippy::too_many_arguments)] // the request's fields
    #[pyo3(signature = (request_id, tenant, prompt_tokens, max_tokens, now_us, *, model=None,
                        prefix_hashes=None))]
    fn submit<'py>(
        &mut self,
        py: Python<'py>,
        request_id: u64,
        tenant: &str,
        prompt_tokens: i64,
        max_tokens: i64,
        now_us: u64,
        model: Option<&str>,
        prefix_hashes: Option<Vec<u64>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let tenant_id = self.inner.tenant_id(tenant)?;
        let prompt = non_negative("prompt_tokens", prompt_tokens)?;
        let max_tokens = non_negative("max_tokens", max_tokens)?;
        let chain = prefix_hashes.unwrap_or_default();
        let route = Route {
            pool: self.inner.pool_of(model)?,
            chain: &chain,
            fingerprint: 0,
        };
        let decision = self.inner.submit(
            request_id,
            Arrival::new(tenant_id, prompt, max_tokens).with_route(route),
            now_us,
        )?;
        let out = match decision {
            Decision::Admitted {
                backend,
                priority,
                prefill,
            } => PyAdmitted {
                request_id,
                backend: self.backend_name(backend),
                priority,
                prefill_backend: prefill.map(|p| self.backend_name(p)),
            }
            .into_pyobject(py)?
            .into_any(),
            Decision::Queued {
                position,
                estimated_wait_s,
                priority,
                displaced,
            } => PyQueued {
                request_id,
                position,
                estimated_wait_s,
                priority,
                displaced: displaced.map(|(id, _)| id),
                displaced_retry_after_s: displaced.map(|(_, retry)| retry),
            }
            .into_pyobject(py)?
            .into_any(),
            Decision::Rejected {
                reason,
                retry_after_s,
            } => PyRejected {
                request_id,
                reason: reason.as_str(),
                retry_after_s,
            }
            .into_pyobject(py)?
            .into_any(),
        };
        Ok(out)
    }

    fn dispatch(&mut self, now_us: u64) -> Vec<PyAdmission> {
        let admissions: Vec<Admission> = self.inner.dispatch(now_us);
        admissions
            .into_iter()
            .map(|a| PyAdmission {
                request_id: a.request_id,
                backend: self.backend_name(a.backend),
                priority: a.priority,
                queue_wait_s: a.queue_wait_us as f64 / 1e6,
                prefill_backend: a.prefill.map(|p| self.backend_name(p)),
            })
            .collect()
    }

    fn prefilled(&mut self, request_id: u64, now_us: u64) -> bool {
        self.inner.prefilled(request_id, now_us)
    }

    fn on_first_token(&mut self, request_id: u64, now_us: u64) {
        self.inner.on_first_token(request_id, now_us);
    }

    fn on_tokens(&mut self, request_id: u64, n: i64, now_us: u64) -> PyResult<()> {
        let n = non_negative("n", n)?;
        self.inner.on_tokens(request_id, n, now_us);
        Ok(())
    }

    fn finish(&mut self, request_id: u64, outcome: &str, now_us: u64) -> PyResult<bool> {
        let outcome = Outcome::parse(outcome).ok_or_else(|| {
            InvalidArgumentError::new_err(format!(
                "outcome must be one of completed, error, timeout, cancelled; got {outcome:?}"
            ))
        })?;
        Ok(self.inner.finish(request_id, outcome, now_us))
    }

    fn expire(&mut self, now_us: u64) -> Vec<PyExpired> {
        let expired: Vec<Expired> = self.inner.expire(now_us);
        expired
            .into_iter()
            .map(|e| PyExpired {
                request_id: e.request_id,
                reason: e.reason.as_str(),
                was_running: e.was_running,
                backend: e.backend.map(|b| self.backend_name(b)),
                retry_after_s: e.retry_after_s,
            })
            .collect()
    }

    fn next_deadline_us(&self) -> Option<u64> {
        self.inner.next_deadline_us()
    }

    #[pyo3(signature = (backend, now_us, *, kv_usage=None, running=None, waiting=None,
                        preemptions_total=None, kv_blocks=None))]
    #[allow(clippy::too_many_arguments)]
    fn observe_backend(
        &mut self,
        backend: &str,
        now_us: u64,
        kv_usage: Option<f64>,
        running: Option<u64>,
        waiting: Option<u64>,
        preemptions_total: Option<u64>,
        kv_blocks: Option<u64>,
    ) -> PyResult<()> {
        let id = self.inner.backend_id(backend)?;
        if let Some(blocks) = kv_blocks {
            self.inner.set_kv_capacity(id, blocks);
        }
        self.inner
            .observe_backend(id, now_us, kv_usage, running, waiting, preemptions_total)?;
        Ok(())
    }

    fn set_backend_health(&mut self, backend: &str, healthy: bool) -> PyResult<()> {
        let id = self.inner.backend_id(backend)?;
        self.inner.set_backend_health(id, healthy);
        Ok(())
    }

    fn start_draining(&mut self) {
        self.inner.start_draining();
    }

    #[getter]
    fn draining(&self) -> bool {
        self.inner.draining
    }

    #[getter]
    fn running(&self) -> u32 {
        self.inner.running()
    }

    #[getter]
    fn queued(&self) -> usize {
        self.inner.queued()
    }

    #[getter]
    fn live(&self) -> usize {
        self.inner.live()
    }

    #[getter]
    fn kv_blocks_in_use(&self) -> u64 {
        self.inner.ledger.total_blocks()
    }

    #[getter]
    fn shed_level(&self) -> u8 {
        self.inner.shed_level
    }

    fn is_live(&self, request_id: u64) -> bool {
        self.inner.is_live(request_id)
    }

    fn request_kv(&self, request_id: u64, now_us: u64) -> Option<(u64, f64)> {
        self.inner.ledger.usage(request_id, now_us)
    }

    fn tenant_service(&self, tenant: &str) -> PyResult<f64> {
        Ok(self.inner.tenant_service(self.inner.tenant_id(tenant)?))
    }

    fn snapshot<'py>(&self, py: Python<'py>, now_us: u64) -> PyResult<Bound<'py, PyAny>> {
        snapshot_to_py(py, &self.inner.snapshot(now_us))
    }

    fn __copy__(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

/// A JSON value as plain Python objects (dict, list, str, int, float, bool, None).
fn to_python<'py>(py: Python<'py>, value: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => u.into_pyobject(py)?.into_any(),
            (None, Some(i)) => i.into_pyobject(py)?.into_any(),
            (None, None) => n.as_f64().into_pyobject(py)?.into_any(),
        },
        Value::String(text) => PyString::new(py, text).into_any(),
        Value::Array(items) => {
            let items = items
                .iter()
                .map(|v| to_python(py, v))
                .collect::<PyResult<Vec<_>>>()?;
            PyList::new(py, items)?.into_any()
        }
        Value::Object(map) => {
            let dict = PyDict::new(py);
            for (key, v) in map {
                dict.set_item(key, to_python(py, v)?)?;
            }
            dict.into_any()
        }
    })
}

/// A governor snapshot as plain Python objects, without a JSON round trip.
pub(crate) fn snapshot_to_py<'py>(
    py: Python<'py>,
    snapshot: &crate::snapshot::Snapshot,
) -> PyResult<Bound<'py, PyAny>> {
    let value = serde_json::to_value(snapshot).map_err(|e| PolicyError::new_err(e.to_string()))?;
    let snapshot = to_python(py, &value)?;
    // Pairs serialise as lists; turn the by-name ones into dicts (in declared order).
    let dict = snapshot.cast::<PyDict>()?;
    pairs_to_dict(dict, "queued_by_tier")?;
    let counters = dict.get_item("counters")?.expect("counters present");
    let counters = counters.cast::<PyDict>()?;
    for key in ["rejected", "finished", "expired"] {
        pairs_to_dict(counters, key)?;
    }
    Ok(snapshot)
}

fn pairs_to_dict(dict: &Bound<'_, PyDict>, key: &str) -> PyResult<()> {
    let Some(pairs) = dict.get_item(key)? else {
        return Ok(());
    };
    let out = PyDict::new(dict.py());
    for pair in pairs.cast::<PyList>()?.iter() {
        let pair = pair.cast::<PyList>()?;
        out.set_item(pair.get_item(0)?, pair.get_item(1)?)?;
    }
    dict.set_item(key, out)
}

/// The chained block hashes of a prompt's bytes (`routing::chain_hashes`), for a host that has
/// no tokens to hash. A per-request call: it keeps the GIL (microseconds for 100 KB).
#[pyfunction]
#[pyo3(signature = (data, chunk, max_blocks=4096))]
pub fn prefix_hashes(data: &[u8], chunk: usize, max_blocks: usize) -> Vec<u64> {
    crate::routing::chain_hashes(data, chunk, max_blocks)
}

#[pyfunction]
pub fn kv_slots(
    vram_bytes: f64,
    weights_bytes: f64,
    activations_bytes: f64,
    avg_context_tokens: f64,
    kv_bytes_per_token: f64,
) -> PyResult<f64> {
    Ok(capacity::kv_slots(
        vram_bytes,
        weights_bytes,
        activations_bytes,
        avg_context_tokens,
        kv_bytes_per_token,
    )?)
}

#[pyfunction]
#[pyo3(signature = (layers, kv_heads, head_dim, dtype_bytes, tp=1))]
pub fn kv_bytes_per_token(
    layers: u64,
    kv_heads: u64,
    head_dim: u64,
    dtype_bytes: u64,
    tp: u64,
) -> PyResult<u64> {
    Ok(capacity::kv_bytes_per_token(
        layers,
        kv_heads,
        head_dim,
        dtype_bytes,
        tp,
    )?)
}
