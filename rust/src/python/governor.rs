//! `Governor`: the admission core called directly, one method per event (the runtime's
//! hosts use `Runtime`; the property tests and benchmarks drive this).

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use super::convert::snapshot_to_py;
use super::decisions::{PyAdmission, PyAdmitted, PyExpired, PyQueued, PyRejected};
use super::errors::{non_negative, ConfigError, InvalidArgumentError};
use super::signature::{Metrics, Signature, METRICS};
use crate::governor::{Arrival, Governor, Route};
use crate::types::{Admission, Decision, Expired, Outcome};

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

    #[pyo3(signature = (*args, **kwargs), text_signature = "($self, request_id, tenant, \
        prompt_tokens, max_tokens, now_us, *, model=None, prefix_hashes=None)")]
    fn submit<'py>(
        &mut self,
        py: Python<'py>,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        const SUBMIT: Signature = Signature {
            full_name: "Governor.submit()",
            positional: &[
                "request_id",
                "tenant",
                "prompt_tokens",
                "max_tokens",
                "now_us",
            ],
            optional: 0,
            keyword_only: &["model", "prefix_hashes"],
        };
        let a = SUBMIT.bind(args, kwargs)?;
        let (request_id, tenant): (u64, &str) = (a.get(0)?, a.get(1)?);
        let (prompt_tokens, max_tokens): (i64, i64) = (a.get(2)?, a.get(3)?);
        let now_us: u64 = a.get(4)?;
        let model: Option<&str> = a.get_or(5, None)?;
        let prefix_hashes: Option<Vec<u64>> = a.get_or(6, None)?;
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

    #[pyo3(signature = (*args, **kwargs), text_signature = "($self, backend, now_us, *, \
        kv_usage=None, running=None, waiting=None, preemptions_total=None, kv_blocks=None)")]
    fn observe_backend(
        &mut self,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<()> {
        const OBSERVE_BACKEND: Signature = Signature {
            full_name: "Governor.observe_backend()",
            positional: &["backend", "now_us"],
            optional: 0,
            keyword_only: METRICS,
        };
        let a = OBSERVE_BACKEND.bind(args, kwargs)?;
        let (backend, now_us): (&str, u64) = (a.get(0)?, a.get(1)?);
        let m = Metrics::from_args(&a, 2)?;
        let id = self.inner.backend_id(backend)?;
        if let Some(blocks) = m.kv_blocks {
            self.inner.set_kv_capacity(id, blocks);
        }
        let (kv, running, waiting) = (m.kv_usage, m.running, m.waiting);
        self.inner
            .observe_backend(id, now_us, kv, running, waiting, m.preemptions_total)?;
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
        self.inner.shed_level()
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
