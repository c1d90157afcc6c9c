//! The PyO3 seam of the native front's pure checks (`front/`): the request checks, the API
//! keys, the client signals and the reply bytes, callable from Python so that tests can hold
//! each against the Python path's own function on the same input.

use std::collections::{HashMap, HashSet};

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::front::auth::{Identity, KeyRing};
use crate::front::prepare::{checked, prepare, Endpoint, FrontConfig, NotServed, Prepared};
use crate::front::reply::{self, Cut};
use crate::front::signals::read_signals;
use crate::front::traceparent;

/// A route the checks take: the two completions', and `/v1/responses`.
fn checked_endpoint(name: &str) -> PyResult<Endpoint> {
    match name {
        "responses" => Ok(Endpoint::Responses),
        _ => endpoint(name),
    }
}

fn endpoint(name: &str) -> PyResult<Endpoint> {
    match name {
        "chat" => Ok(Endpoint::Chat),
        "completions" => Ok(Endpoint::Completions),
        _ => Err(super::InvalidArgumentError::new_err(format!(
            "endpoint must be 'chat' or 'completions', got {name:?}"
        ))),
    }
}

/// `CompletionService.prepare`'s checks, with its arguments.
#[pyclass(name = "FrontChecks", module = "llmflow._core", frozen)]
pub struct PyFrontChecks {
    pub(super) config: FrontConfig,
}

#[pymethods]
impl PyFrontChecks {
    #[new]
    #[pyo3(signature = (
        models, bytes_per_token, streaming, max_messages, max_n, max_tokens, fingerprint_key,
        *, aliases, prefix_models, block_size
    ))]
    #[allow(clippy::too_many_arguments)] // CompletionService's own arguments, one for one
    fn new(
        models: HashMap<String, u64>,
        bytes_per_token: f64,
        streaming: bool,
        max_messages: u64,
        max_n: u64,
        max_tokens: Option<u64>,
        fingerprint_key: Vec<u8>,
        aliases: HashMap<String, String>,
        prefix_models: HashSet<String>,
        block_size: u64,
    ) -> PyResult<Self> {
        if !(bytes_per_token.is_finite() && bytes_per_token > 0.0) || fingerprint_key.len() > 64 {
            return Err(super::InvalidArgumentError::new_err(
                "bytes_per_token must be a finite number above 0, fingerprint_key 64 bytes at most",
            ));
        }
        let config = FrontConfig {
            models,
            aliases,
            prefix_models,
            block_size,
            bytes_per_token,
            streaming,
            max_messages,
            max_n,
            max_tokens,
            fingerprint_key,
        };
        Ok(Self { config })
    }

    fn prepare(&self, endpoint_name: &str, raw: &[u8]) -> PyResult<Option<PyFrontPrepared>> {
        let prepared = prepare(checked_endpoint(endpoint_name)?, raw, &self.config);
        Ok(prepared.map(|inner| PyFrontPrepared { inner }))
    }

    /// The error the front answers this body with, on the wire (None: it serves the body, or
    /// passes it to the app).
    #[allow(clippy::needless_pass_by_value)] // PyO3 hands the Python list over as an owned Vec
    fn refusal<'py>(
        &self,
        py: Python<'py>,
        endpoint_name: &str,
        raw: &[u8],
        default_headers: Vec<(Vec<u8>, Vec<u8>)>,
        keep_alive: bool,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let Err(NotServed::Refused(error)) =
            checked(checked_endpoint(endpoint_name)?, raw, &self.config)
        else {
            return Ok(None);
        };
        Ok(Some(wire(py, &error, &default_headers, keep_alive)))
    }
}

/// A request the native front would serve: every value of Python's `Prepared`.
#[pyclass(name = "FrontPrepared", module = "llmflow._core", frozen)]
pub struct PyFrontPrepared {
    inner: Prepared,
}

#[pymethods]
impl PyFrontPrepared {
    #[getter]
    fn endpoint(&self) -> &'static str {
        match self.inner.endpoint {
            Endpoint::Chat => "chat",
            Endpoint::Completions => "completions",
            Endpoint::Responses => "responses",
        }
    }
    #[getter]
    fn path(&self) -> &'static str {
        self.inner.endpoint.path()
    }
    #[getter]
    fn asked_model(&self) -> &str {
        &self.inner.asked_model
    }
    #[getter]
    fn model(&self) -> &str {
        &self.inner.model
    }
    #[getter]
    fn stream(&self) -> bool {
        self.inner.stream
    }
    #[getter]
    fn choices(&self) -> u64 {
        self.inner.choices
    }
    #[getter]
    fn include_usage(&self) -> bool {
        self.inner.include_usage
    }
    #[getter]
    fn continuous_usage(&self) -> bool {
        self.inner.continuous_usage
    }
    #[getter]
    fn prompt_tokens(&self) -> u64 {
        self.inner.prompt_tokens
    }
    #[getter]
    fn planned_tokens(&self) -> u64 {
        self.inner.planned_tokens
    }
    #[getter]
    fn max_tokens(&self) -> Option<u64> {
        self.inner.max_tokens
    }
    #[getter]
    fn prefix_hashes(&self) -> Option<Vec<u64>> {
        self.inner.prefix_hashes.clone()
    }
    #[getter]
    fn fingerprint(&self) -> u64 {
        self.inner.fingerprint
    }
    #[getter]
    fn unstreamed(&self) -> bool {
        self.inner.unstreamed
    }
    #[getter]
    fn body<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.body_bytes())
    }

    #[pyo3(signature = (priority=None, max_tokens=None))]
    fn upstream_body<'py>(
        &self,
        py: Python<'py>,
        priority: Option<i64>,
        max_tokens: Option<u64>,
    ) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.upstream_bytes(priority, max_tokens))
    }
}

/// `KeyRing.authenticate`'s checks.
#[pyclass(name = "FrontKeys", module = "llmflow._core", frozen)]
pub struct PyFrontKeys {
    pub(super) inner: KeyRing,
}

#[pymethods]
impl PyFrontKeys {
    #[new]
    #[allow(clippy::needless_pass_by_value)] // PyO3 hands the Python list over as an owned Vec
    fn new(
        enabled: bool,
        anonymous: (String, String),
        max_bytes: usize,
        keys: Vec<(Vec<u8>, String, String)>,
    ) -> Self {
        let who = |(tenant, tier): (String, String)| Identity { tenant, tier };
        let keys = keys
            .into_iter()
            .map(|(key, tenant, tier)| (key, who((tenant, tier))));
        Self {
            inner: KeyRing::new(enabled, who(anonymous), max_bytes, keys.collect()),
        }
    }

    #[pyo3(signature = (authorization))]
    fn authenticate(&self, authorization: Option<&[u8]>) -> Option<(String, String)> {
        let who = self.inner.authenticate(authorization)?;
        Some((who.tenant.clone(), who.tier.clone()))
    }

    /// The 401 the front answers for this header, on the wire (None: the key opens a tenant).
    #[pyo3(signature = (authorization, default_headers, keep_alive))]
    #[allow(clippy::needless_pass_by_value)] // PyO3 hands the Python list over as an owned Vec
    fn refusal<'py>(
        &self,
        py: Python<'py>,
        authorization: Option<&[u8]>,
        default_headers: Vec<(Vec<u8>, Vec<u8>)>,
        keep_alive: bool,
    ) -> Option<Bound<'py, PyBytes>> {
        let message = self.inner.check(authorization).err()?;
        let error = reply::ErrorReply::unauthorized(message);
        Some(wire(py, &error, &default_headers, keep_alive))
    }
}

/// An error's response bytes as the front writes them (`default_headers`: the server's own).
fn wire<'py>(
    py: Python<'py>,
    error: &reply::ErrorReply,
    default_headers: &[(Vec<u8>, Vec<u8>)],
    keep_alive: bool,
) -> Bound<'py, PyBytes> {
    let headers: Vec<(&[u8], &[u8])> = default_headers
        .iter()
        .map(|(n, v)| (n.as_slice(), v.as_slice()))
        .collect();
    PyBytes::new(py, &error.response_bytes(&headers, keep_alive))
}

/// `read_signals`: `(retries, deadline_ms)`, or None where Python answers 400.
#[pyfunction]
#[allow(clippy::needless_pass_by_value)] // PyO3 hands the Python list over as an owned Vec
pub fn front_signals(headers: Vec<(Vec<u8>, Vec<u8>)>) -> Option<(Option<u32>, Option<u64>)> {
    let pairs = headers.iter().map(|(n, v)| (n.as_slice(), v.as_slice()));
    let signals = read_signals(pairs).ok()?;
    Some((signals.retries, signals.deadline_ms))
}

/// A client's `traceparent` as the front reads it: `(trace_id, span_id, flags)`, or None
/// where it starts a trace of its own.
#[pyfunction]
pub fn front_traceparent(header: &[u8]) -> Option<(u128, u64, u8)> {
    traceparent::parse(header).map(|p| (p.trace_id, p.span_id, p.flags))
}

/// Whether the front samples a trace it starts with this id, at this ratio.
#[pyfunction]
pub fn front_trace_sampled(trace_id: u128, sample_ratio: f64) -> bool {
    traceparent::sampled_by_ratio(trace_id, traceparent::ratio_bound(sample_ratio))
}

/// The bytes of a runtime refusal on the wire (uvicorn's writing of `reply_error(...).response()`);
/// `upstream`: `(status, code, message, error JSON or None)` of a backend's failure, for the
/// reason `upstream_error`.
#[pyfunction]
#[pyo3(signature = (reason, status, retry_after_s, request_id, default_headers, keep_alive, upstream=None))]
#[allow(clippy::too_many_arguments)] // reply_error's and _reply_bytes' own arguments
#[allow(clippy::needless_pass_by_value)] // PyO3 hands the Python list over as an owned Vec
pub fn front_refusal_bytes<'py>(
    py: Python<'py>,
    reason: &str,
    status: u16,
    retry_after_s: Option<u64>,
    request_id: u64,
    default_headers: Vec<(Vec<u8>, Vec<u8>)>,
    keep_alive: bool,
    upstream: Option<(u16, String, String, Option<String>)>,
) -> Bound<'py, PyBytes> {
    let error = match &upstream {
        Some((failed, code, message, error)) => reply::upstream_reply_error(
            status,
            retry_after_s,
            request_id,
            (*failed, code, message),
            error.as_deref(),
        ),
        None => reply::reply_error(reason, status, retry_after_s, request_id),
    };
    wire(py, &error, &default_headers, keep_alive)
}

/// `encode_event(tail_chunk(...))` of a reply the runtime cut.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // tail_chunk's own arguments, and the clock
#[allow(clippy::needless_pass_by_value)] // PyO3 hands the Python list over as an owned Vec
pub fn front_cut_frame<'py>(
    py: Python<'py>,
    endpoint_name: &str,
    model: &str,
    template: Option<&str>,
    open_choices: Vec<u64>,
    reason: &str,
    request_id: u64,
    now_s: u64,
) -> PyResult<Bound<'py, PyBytes>> {
    let cut = Cut {
        endpoint: endpoint(endpoint_name)?,
        model,
        template,
        open_choices: &open_choices,
        reason,
        request_id,
        now_s,
    };
    Ok(PyBytes::new(py, &reply::cut_frame(&cut)))
}

/// `encode_event({"error": in_band_error(...)})`.
#[pyfunction]
pub fn front_in_band_error<'py>(
    py: Python<'py>,
    error: Option<&str>,
    message: &str,
    code: &str,
) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &reply::in_band_error_frame(error, message, code))
}

/// A non-streamed reply assembled from upstream `payloads` (each a `data:` payload), as the
/// native front assembles it (`front/whole.rs`): `JSONResponse`'s body, or the failure's
/// message at the first payload the fold does not take. `cut`: `(reason, request_id)` of a
/// cut after the payloads; `now_s`: the clock's whole seconds; `n`: the choices asked for.
#[pyfunction]
#[pyo3(signature = (endpoint_name, model, payloads, now_s, cut=None, n=1))]
#[allow(clippy::needless_pass_by_value)] // PyO3 hands the Python list over as an owned Vec
pub fn front_whole_reply(
    py: Python<'_>,
    endpoint_name: &str,
    model: &str,
    payloads: Vec<Vec<u8>>,
    now_s: u64,
    cut: Option<(String, u64)>,
    n: u64,
) -> PyResult<Py<PyAny>> {
    let mut whole = crate::front::whole::Whole::new(endpoint(endpoint_name)?, model, n);
    // As a whole stream runs: the relay's shaper checks each payload (and fails the stream
    // on a shape `ChunkParser` refuses) before the fold sees it.
    let mut shaper = crate::relay::chunk::ChunkShaper::shaped(true, false, n);
    for payload in &payloads {
        if let Err(failure) = shaper.feed(payload) {
            return Ok(failure.message.into_pyobject(py)?.into_any().unbind());
        }
        if let Err(unread) = whole.feed(payload) {
            return Ok(unread.message().into_pyobject(py)?.into_any().unbind());
        }
    }
    if let Some((reason, request_id)) = cut {
        whole.cut(&reason, request_id, now_s);
    }
    Ok(PyBytes::new(py, &whole.body(now_s)).into_any().unbind())
}

/// What the relay writes to a streaming client for upstream `payloads` (each a `data:`
/// payload), before any coalescing: every frame the shaper gives, in order, then the held
/// finishing chunks at `[DONE]`, or with `cut` (`(reason, request_id)`) the cut's frames as
/// the relay writes them (`ChunkShaper::cut`, the front's notice); or the failure's message
/// at the first payload that fails the stream. `now_s`: the clock's whole seconds.
#[pyfunction]
#[pyo3(signature = (endpoint_name, model, payloads, now_s, include_usage, continuous_usage, n, cut=None))]
#[allow(clippy::needless_pass_by_value, clippy::too_many_arguments)] // PyO3 hands over owned
pub fn front_stream_frames(
    py: Python<'_>,
    endpoint_name: &str,
    model: &str,
    payloads: Vec<Vec<u8>>,
    now_s: u64,
    include_usage: bool,
    continuous_usage: bool,
    n: u64,
    cut: Option<(String, u64)>,
) -> PyResult<Py<PyAny>> {
    let endpoint = endpoint(endpoint_name)?;
    let mut shaper = crate::relay::chunk::ChunkShaper::shaped(include_usage, continuous_usage, n);
    let mut out = Vec::new();
    for payload in &payloads {
        match shaper.feed(payload) {
            Ok(fed) => out.extend(fed.before.into_iter().chain(fed.frame).flatten()),
            Err(failure) => return Ok(failure.message.into_pyobject(py)?.into_any().unbind()),
        }
    }
    match cut {
        None => out.extend(shaper.take_held().into_iter().flatten()),
        Some((reason, request_id)) => {
            let ending = reply::cut_notice(endpoint, model.to_owned(), reason, request_id, now_s);
            out.extend(shaper.cut(ending).0.into_iter().flatten());
        }
    }
    Ok(PyBytes::new(py, &out).into_any().unbind())
}

/// The relay's coalescing of frames waiting for the flush interval (`merge_frames`, the
/// twin of `streaming.merge_chunks`).
#[pyfunction]
pub fn front_merge_frames(py: Python<'_>, frames: Vec<Vec<u8>>) -> Vec<Bound<'_, PyBytes>> {
    crate::relay::chunk::merge_frames(frames)
        .iter()
        .map(|frame| PyBytes::new(py, frame))
        .collect()
}

/// Whether a reply cut for `reason` names it in `x-llmflow-reason`, as the front decides
/// (`contract.REFUSALS[reason].cut` on the Python side).
#[pyfunction]
pub fn front_cut_names_itself(reason: &str) -> bool {
    crate::front::reply::names_itself_when_cut(reason)
}

/// `middleware.foreign_request`: why a keyless gateway refuses a request with this Host and
/// Origin (the first of each, raw), or None; `allowed`: its own names, lower-cased. The rule
/// lives in `front/origin.rs`, which the front answers its own requests with.
#[pyfunction]
#[allow(clippy::needless_pass_by_value)] // PyO3 hands the Python set over as an owned set
pub fn front_foreign_request(
    host: Option<&[u8]>,
    origin: Option<&[u8]>,
    allowed: HashSet<String>,
) -> Option<String> {
    crate::front::origin::foreign_request(host, origin, |name| allowed.contains(name))
}
