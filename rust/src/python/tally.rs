//! The PyO3 seam of the gateway's per-request tally (`crate::tally`): `Tally()`, which the
//! Python path's sessions count in and the native routes share (`NativeRoutes(tally=...)`),
//! and the outcome mapping the spans read (`request_outcome`).

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::tally::{Count, Ended, Histogram, Refused, Tally, E2E_BUCKETS, TTFT_BUCKETS};

/// The gateway's per-request counts and its access log.
#[pyclass(name = "Tally", module = "llmflow._core", frozen)]
pub struct PyTally {
    pub inner: Arc<Tally>,
}

#[pymethods]
impl PyTally {
    #[new]
    fn new() -> Self {
        Self {
            inner: Arc::new(Tally::new()),
        }
    }

    /// Write the access log to `path` (`shadow`: with the `shadow` column).
    #[pyo3(signature = (path, shadow=false))]
    #[allow(clippy::needless_pass_by_value)] // PyO3 hands a str or a PathLike over owned
    fn open_log(&self, path: PathBuf, shadow: bool) -> PyResult<()> {
        self.inner
            .open_log(&path, shadow)
            .map_err(|e| PyOSError::new_err(format!("{}: {e}", path.display())))
    }

    fn close_log(&self) {
        self.inner.close_log();
    }

    fn first_token(&self, tier: &str, ttft_s: f64) {
        self.inner.first_token(tier, ttft_s);
    }

    fn truncated(&self, reason: &str) {
        self.inner.truncated(reason);
    }

    fn upstream_aborted(&self, reason: &str) {
        self.inner.upstream_aborted(reason);
    }

    #[pyo3(signature = (
        request, tier, tenant, arrived_s, prompt_tokens, max_tokens, status, code, at_s=None
    ))]
    #[allow(clippy::too_many_arguments)] // a refusal's row, one argument a cell
    fn refused(
        &self,
        request: Option<String>,
        tier: String,
        tenant: String,
        arrived_s: f64,
        prompt_tokens: u64,
        max_tokens: Option<u64>,
        status: u16,
        code: String,
        at_s: Option<f64>,
    ) {
        self.inner.refused(&Refused {
            request,
            tier,
            tenant,
            arrived_s,
            at_s,
            prompt_tokens,
            max_tokens,
            status,
            code,
        });
    }

    #[pyo3(signature = (
        request, tier, tenant, arrived_s, *, queue_wait_s, first_token_s, ended_s,
        prompt_tokens, max_tokens, completion_tokens, end, error_status, backend, shadow
    ))]
    #[allow(clippy::too_many_arguments)] // an end's row, one argument a cell
    fn ended(
        &self,
        request: Option<String>,
        tier: String,
        tenant: String,
        arrived_s: f64,
        queue_wait_s: Option<f64>,
        first_token_s: Option<f64>,
        ended_s: Option<f64>,
        prompt_tokens: u64,
        max_tokens: Option<u64>,
        completion_tokens: u64,
        end: String,
        error_status: Option<u16>,
        backend: Option<String>,
        shadow: Option<String>,
    ) {
        self.inner.ended(&Ended {
            request,
            tier,
            tenant,
            arrived_s,
            queue_wait_s,
            first_token_s,
            ended_s,
            prompt_tokens,
            max_tokens,
            completion_tokens,
            end,
            error_status,
            backend,
            shadow,
        });
    }

    /// Every per-request family as it stands, as a dict of lists.
    fn families<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let counts = self.inner.counts();
        let d = PyDict::new(py);
        let requests = PyList::empty(py);
        for ((tier, outcome, reason), c) in &counts.requests {
            requests.append((tier, outcome, reason, c.value, c.created))?;
        }
        d.set_item("requests", requests)?;
        for (name, family) in [
            ("ttft", &counts.ttft),
            ("e2e", &counts.e2e),
            ("queue_wait", &counts.queue_wait),
        ] {
            d.set_item(name, histograms(py, family)?)?;
        }
        for (name, family) in [
            ("tokens", &counts.tokens),
            ("truncations", &counts.truncations),
            ("aborts", &counts.aborts),
        ] {
            d.set_item(name, counters(py, family)?)?;
        }
        Ok(d)
    }

    /// (`llmflow_ttft_seconds` and `llmflow_queue_wait_seconds`' bounds, `llmflow_e2e_seconds`').
    #[staticmethod]
    fn bounds() -> (Vec<f64>, Vec<f64>) {
        (TTFT_BUCKETS.to_vec(), E2E_BUCKETS.to_vec())
    }
}

fn histograms<'py>(
    py: Python<'py>,
    family: &[(String, Histogram)],
) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    for (tier, h) in family {
        out.append((tier, h.counts.clone(), h.sum, h.created))?;
    }
    Ok(out)
}

fn counters<'py>(py: Python<'py>, family: &[(String, Count)]) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    for (label, c) in family {
        out.append((label, c.value, c.created))?;
    }
    Ok(out)
}

/// A request's outcome in the simulator's words and its reason (None when completed).
#[pyfunction]
#[pyo3(signature = (end, error_status, completion_tokens))]
pub fn request_outcome(
    end: &str,
    error_status: Option<u16>,
    completion_tokens: u64,
) -> (&'static str, Option<String>) {
    let (outcome, has_reason) = crate::tally::log_outcome(end, error_status, completion_tokens);
    (outcome, has_reason.then(|| end.to_owned()))
}

/// The access log's `shadow` cell for a verdict.
#[pyfunction]
pub fn shadow_summary(
    decision: &str,
    queued_first: bool,
    reason: Option<&str>,
    started: bool,
) -> String {
    crate::shadow::summary(decision, queued_first, reason, started)
}
