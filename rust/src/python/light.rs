//! The PyO3 seam of the light lane (`light.rs`): thin wrappers, one method per call.

use pyo3::prelude::*;

use crate::light::{LightDecision, LightLane};

/// The light lane refused a request: answer with this status and Retry-After.
#[pyclass(name = "LightRefusal", module = "llmflow._core", frozen, get_all)]
pub struct PyLightRefusal {
    status: u16,
    reason: &'static str,
    retry_after_s: u32,
}

#[pymethods]
impl PyLightRefusal {
    fn __repr__(&self) -> String {
        format!(
            "LightRefusal(status={}, reason={:?}, retry_after_s={})",
            self.status, self.reason, self.retry_after_s
        )
    }
}

/// Per-backend caps on the routes that generate no tokens.
#[pyclass(name = "LightLane", module = "llmflow._core")]
pub struct PyLightLane {
    inner: LightLane,
}

#[pymethods]
impl PyLightLane {
    #[new]
    #[allow(clippy::needless_pass_by_value)] // PyO3 hands the Python list over as an owned Vec
    fn new(backends: Vec<(String, u32)>) -> PyResult<Self> {
        Ok(Self {
            inner: LightLane::new(&backends)?,
        })
    }

    fn set_rate(&mut self, tenant: &str, requests_per_s: f64) -> PyResult<()> {
        Ok(self.inner.set_rate(tenant, requests_per_s)?)
    }

    fn set_tier_share(&mut self, tier: &str, shed_at: f64) -> PyResult<()> {
        Ok(self.inner.set_tier_share(tier, shed_at)?)
    }

    #[pyo3(signature = (request_id, candidates, now_us, tenant=None, tier=None))]
    #[allow(clippy::needless_pass_by_value)] // PyO3 hands the Python list over as an owned Vec
    fn acquire(
        &mut self,
        py: Python<'_>,
        request_id: u64,
        candidates: Vec<String>,
        now_us: u64,
        tenant: Option<&str>,
        tier: Option<&str>,
    ) -> PyResult<Py<PyAny>> {
        let decision = self
            .inner
            .acquire_for(tenant, tier, request_id, &candidates, now_us)?;
        Ok(match decision {
            LightDecision::Admit { backend } => backend.into_pyobject(py)?.into_any().unbind(),
            LightDecision::Refuse {
                status,
                reason,
                retry_after_s,
            } => Py::new(
                py,
                PyLightRefusal {
                    status,
                    reason,
                    retry_after_s,
                },
            )?
            .into_any(),
        })
    }

    fn release(&mut self, request_id: u64, now_us: u64) -> bool {
        self.inner.release(request_id, now_us)
    }

    fn set_health(&mut self, backend: &str, healthy: bool) -> PyResult<()> {
        Ok(self.inner.set_health(backend, healthy)?)
    }

    fn start_draining(&mut self) {
        self.inner.start_draining();
    }

    fn in_flight(&self, backend: &str) -> PyResult<u32> {
        Ok(self.inner.in_flight(backend)?)
    }

    fn live(&self) -> usize {
        self.inner.live()
    }
}
