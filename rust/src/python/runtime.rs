//! The PyO3 seam of the runtime: one method per event; the actions it answers are the small
//! frozen classes of `actions`.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use super::actions::action_to_py;
use super::convert::snapshot_to_py;
use super::errors::{non_negative, ConfigError, InvalidArgumentError, TraceMismatchError};
use super::signature::{Metrics, Signature, METRICS};
use crate::governor::{Arrival, Route, Signals};
use crate::hosted::{wait_all, Hosted, SharedRuntime, ABORT_WAIT};
use crate::runtime::{Event, Runtime};
use crate::trace;
use std::sync::MutexGuard;

/// A verdict as Python's `shadow.Verdict` takes it: decision, queued first, reason, status,
/// Retry-After, backend, brownout.
pub type VerdictTuple = (
    &'static str,
    bool,
    Option<&'static str>,
    Option<u16>,
    Option<u32>,
    Option<String>,
    Option<u64>,
);

pub fn verdict_tuple(v: crate::shadow::Verdict) -> VerdictTuple {
    (
        v.decision.as_str(),
        v.queued_first,
        v.reason.map(crate::runtime::Reason::as_str),
        v.status,
        v.retry_after_s,
        v.backend,
        v.brownout,
    )
}

/// A runtime built from a config mapping, traced or not.
fn built(py: Python<'_>, config: &Bound<'_, PyAny>, trace: bool) -> PyResult<Hosted> {
    if !config.is_instance_of::<PyDict>() {
        return Err(ConfigError::new_err(format!(
            "config must be a mapping (dict), got {}",
            config.get_type().name()?
        )));
    }
    let json = py.import("json")?.call_method1("dumps", (config,))?;
    let text: &str = json.extract()?;
    let inner = Runtime::from_json(text)?;
    let trace = if trace {
        Some(trace::header(text)?)
    } else {
        None
    };
    Ok(Hosted::new(inner, trace))
}

/// The request lifecycle around the governor; see `llmflow._core.pyi`.
#[pyclass(name = "Runtime", module = "llmflow._core")]
pub struct PyRuntime {
    shared: SharedRuntime,
}

/// A client's signals as `arrive` and `refusal` take them: counts and milliseconds, never
/// negative (the host leaves out what the client did not say or said wrongly).
fn signals(retries: Option<i64>, deadline_ms: Option<i64>) -> PyResult<Signals> {
    let retries = retries.map(|n| non_negative("retries", n)).transpose()?;
    let deadline_ms = deadline_ms
        .map(|ms| non_negative("deadline_ms", ms))
        .transpose()?;
    Ok(Signals {
        retries: retries.map(|n| u32::try_from(n).unwrap_or(u32::MAX)),
        deadline_us: deadline_ms.map(|ms| ms.saturating_mul(1000)),
    })
}

impl PyRuntime {
    /// The runtime this object shares with the native front, when one serves beside Python.
    pub(super) fn shared(&self) -> SharedRuntime {
        std::sync::Arc::clone(&self.shared)
    }

    fn core(&self) -> MutexGuard<'_, Hosted> {
        Hosted::lock(&self.shared)
    }

    fn feed(&mut self, py: Python<'_>, now_us: u64, event: &Event) -> PyResult<Py<PyAny>> {
        let list = pyo3::types::PyList::empty(py);
        self.feed_into(py, now_us, event, &list)?;
        Ok(list.into_any().unbind())
    }

    /// Feed one event and append its actions to `list` (those of requests the native front
    /// serves go to it instead).
    fn feed_into(
        &mut self,
        py: Python<'_>,
        now_us: u64,
        event: &Event,
        list: &Bound<'_, pyo3::types::PyList>,
    ) -> PyResult<()> {
        let mut converted = Ok(());
        let mut hosted = Hosted::lock(&self.shared);
        hosted.feed(now_us, event, |runtime, action| {
            if converted.is_ok() {
                converted =
                    action_to_py(py, runtime.governor(), action).and_then(|a| list.append(a));
            }
        })?;
        // A native `Start` behind an `Abort` Python carries out waits for `carried()`.
        let gates = hosted.take_gates();
        hosted.hold_for_python(gates);
        // Python's own `Start`s wait for the relay's aborts before them to reach their sockets.
        let waits = hosted.take_caller_waits();
        drop(hosted);
        if !waits.is_empty() {
            py.detach(|| wait_all(&waits, ABORT_WAIT));
        }
        converted
    }

    fn backend(&self, name: &str) -> PyResult<u32> {
        Ok(self.core().runtime().governor().backend_id(name)?)
    }
}

#[pymethods]
impl PyRuntime {
    #[new]
    #[pyo3(signature = (config, *, trace=false, shadow=None))]
    fn new(
        py: Python<'_>,
        config: &Bound<'_, PyAny>,
        trace: bool,
        shadow: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let Some(policy) = shadow else {
            return Ok(Self {
                shared: built(py, config, trace)?.shared(),
            });
        };
        // Shadow mode: this runtime forwards, untraced; the policy runtime is the traced one.
        let policy = built(py, policy, trace)?;
        Ok(Self {
            shared: built(py, config, false)?.with_shadow(policy).shared(),
        })
    }

    /// Shadow mode's policy runtime (None: not in shadow mode), for queries: feed this one.
    #[getter]
    fn shadow(&self) -> Option<Self> {
        let core = self.core();
        core.shadow().map(|s| Self {
            shared: std::sync::Arc::clone(s.policy()),
        })
    }

    /// Shadow mode: what the policy runtime did with a request whose real one has ended, once.
    fn take_verdict(&self, request_id: u64) -> Option<VerdictTuple> {
        let mut core = self.core();
        core.shadow_mut()?.take(request_id).map(verdict_tuple)
    }

    /// Shadow mode: the policy runtime's would-haves so far, `(what, tier, reason, count)`.
    fn shadow_tally(&self) -> Vec<(&'static str, String, Option<&'static str>, u64)> {
        let core = self.core();
        core.shadow().map_or_else(Vec::new, |s| {
            s.tally()
                .iter()
                .map(|((what, tier, reason), n)| (*what, tier.clone(), *reason, *n))
                .collect()
        })
    }

    /// Shadow mode: requests whose verdict is still kept (0 when everything has ended).
    #[getter]
    fn shadow_held(&self) -> usize {
        self.core().shadow().map_or(0, crate::shadow::Shadow::held)
    }

    #[pyo3(signature = (*args, **kwargs), text_signature = "($self, request_id, tenant, \
        prompt_tokens, max_tokens, stream, now_us, *, model=None, prefix_hashes=None, \
        fingerprint=0, retries=None, deadline_ms=None)")]
    fn arrive(
        &mut self,
        py: Python<'_>,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Py<PyAny>> {
        const ARRIVE: Signature = Signature {
            full_name: "Runtime.arrive()",
            positional: &[
                "request_id",
                "tenant",
                "prompt_tokens",
                "max_tokens",
                "stream",
                "now_us",
            ],
            optional: 0,
            keyword_only: &[
                "model",
                "prefix_hashes",
                "fingerprint",
                "retries",
                "deadline_ms",
            ],
        };
        let a = ARRIVE.bind(args, kwargs)?;
        let (request_id, tenant): (u64, &str) = (a.get(0)?, a.get(1)?);
        let (prompt_tokens, max_tokens): (i64, i64) = (a.get(2)?, a.get(3)?);
        let (stream, now_us): (bool, u64) = (a.get(4)?, a.get(5)?);
        let model: Option<&str> = a.get_or(6, None)?;
        let prefix_hashes: Option<Vec<u64>> = a.get_or(7, None)?;
        let fingerprint: u64 = a.get_or(8, 0)?;
        let signals = signals(a.get_or(9, None)?, a.get_or(10, None)?)?;
        let (tenant, pool) = {
            let core = self.core();
            let gov = core.runtime().governor();
            (gov.tenant_id(tenant)?, gov.pool_of(model)?)
        };
        let event = Event::Arrive {
            id: request_id,
            tenant,
            prompt: non_negative("prompt_tokens", prompt_tokens)?,
            max_tokens: non_negative("max_tokens", max_tokens)?,
            stream,
            pool,
            chain: prefix_hashes.unwrap_or_default(),
            fingerprint,
            retries: signals.retries,
            deadline_ms: signals.deadline_us.map(|us| us / 1000),
        };
        self.feed(py, now_us, &event)
    }

    /// Every model name a request may send, with the served model its pool is named after
    /// (a served name maps to itself, an alias to its target). Empty when no backend declares
    /// its models (then any name is taken).
    fn models(&self) -> Vec<(String, String)> {
        self.core().runtime().governor().pools().table()
    }

    /// Every model pool: its served model ("" for the one pool of a config whose backends name
    /// none), its routing policy, and the backends that serve it, in config order. With
    /// `models` this is the model table every host reads.
    fn pools(&self) -> Vec<(String, &'static str, Vec<String>)> {
        let core = self.core();
        let gov = core.runtime().governor();
        let pools = gov.pools();
        (0..pools.len() as u32)
            .map(|p| {
                let backends = pools.members(p);
                let names = backends.map(|b| gov.backend_name(b as u32).to_owned());
                (
                    pools.name(p).to_owned(),
                    pools.policy(p).as_str(),
                    names.collect(),
                )
            })
            .collect()
    }

    /// The served model a request naming `model` is routed to (an alias resolved), or None
    /// when the config names no models. Raises `UnknownModelError` for a name nobody serves.
    #[pyo3(signature = (model=None))]
    fn resolve_model(&self, model: Option<&str>) -> PyResult<Option<String>> {
        let core = self.core();
        let pools = core.runtime().governor().pools();
        let pool = pools.resolve(model)?;
        let name = pools.name(pool);
        Ok((!name.is_empty()).then(|| name.to_owned()))
    }

    /// What `arrive` would answer now if it refused at once: (status, reason, Retry-After).
    #[pyo3(signature = (*args, **kwargs), text_signature = "($self, tenant, prompt_tokens, \
        max_tokens, now_us, *, model=None, fingerprint=0, retries=None, deadline_ms=None)")]
    fn refusal(
        &self,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Option<(u16, &'static str, u32)>> {
        const REFUSAL: Signature = Signature {
            full_name: "Runtime.refusal()",
            positional: &["tenant", "prompt_tokens", "max_tokens", "now_us"],
            optional: 0,
            keyword_only: &["model", "fingerprint", "retries", "deadline_ms"],
        };
        let a = REFUSAL.bind(args, kwargs)?;
        let tenant: &str = a.get(0)?;
        let (prompt_tokens, max_tokens): (i64, i64) = (a.get(1)?, a.get(2)?);
        let now_us: u64 = a.get(3)?;
        let model: Option<&str> = a.get_or(4, None)?;
        let fingerprint: u64 = a.get_or(5, 0)?;
        let signals = signals(a.get_or(6, None)?, a.get_or(7, None)?)?;
        let core = self.core();
        let gov = core.runtime().governor();
        let route = Route {
            pool: gov.pool_of(model)?,
            chain: &[],
            fingerprint,
        };
        let arrival = Arrival::new(
            gov.tenant_id(tenant)?,
            non_negative("prompt_tokens", prompt_tokens)?,
            non_negative("max_tokens", max_tokens)?,
        );
        let arrival = arrival.with_route(route).with_signals(signals);
        let refused = core.runtime().refusal(arrival, now_us)?;
        Ok(refused.map(|r| (r.status, r.reason.as_str(), r.retry_after_s)))
    }

    fn started(&mut self, py: Python<'_>, request_id: u64, now_us: u64) -> PyResult<Py<PyAny>> {
        self.feed(py, now_us, &Event::Started { id: request_id })
    }

    fn prefilled(&mut self, py: Python<'_>, request_id: u64, now_us: u64) -> PyResult<Py<PyAny>> {
        self.feed(py, now_us, &Event::Prefilled { id: request_id })
    }

    fn tokens(
        &mut self,
        py: Python<'_>,
        request_id: u64,
        n: i64,
        now_us: u64,
    ) -> PyResult<Py<PyAny>> {
        let n = non_negative("n", n)?;
        self.feed(py, now_us, &Event::Tokens { id: request_id, n })
    }

    /// `tokens` for many requests at once (the relay's periodic batch); one list of actions.
    fn tokens_many(
        &mut self,
        py: Python<'_>,
        counts: Vec<(u64, u64)>,
        now_us: u64,
    ) -> PyResult<Py<PyAny>> {
        let list = pyo3::types::PyList::empty(py);
        for (id, n) in counts {
            self.feed_into(py, now_us, &Event::Tokens { id, n }, &list)?;
        }
        Ok(list.into_any().unbind())
    }

    fn done(&mut self, py: Python<'_>, request_id: u64, now_us: u64) -> PyResult<Py<PyAny>> {
        self.feed(py, now_us, &Event::Done { id: request_id })
    }

    #[pyo3(signature = (request_id, status, now_us, *, backend_down=false))]
    fn failed(
        &mut self,
        py: Python<'_>,
        request_id: u64,
        status: u16,
        now_us: u64,
        backend_down: bool,
    ) -> PyResult<Py<PyAny>> {
        let event = Event::Failed {
            id: request_id,
            status,
            backend_down,
        };
        self.feed(py, now_us, &event)
    }

    fn client_gone(&mut self, py: Python<'_>, request_id: u64, now_us: u64) -> PyResult<Py<PyAny>> {
        self.feed(py, now_us, &Event::ClientGone { id: request_id })
    }

    fn window_full(&mut self, py: Python<'_>, request_id: u64, now_us: u64) -> PyResult<Py<PyAny>> {
        self.feed(py, now_us, &Event::WindowFull { id: request_id })
    }

    fn window_drained(
        &mut self,
        py: Python<'_>,
        request_id: u64,
        now_us: u64,
    ) -> PyResult<Py<PyAny>> {
        self.feed(py, now_us, &Event::WindowDrained { id: request_id })
    }

    fn timer(&mut self, py: Python<'_>, now_us: u64) -> PyResult<Py<PyAny>> {
        self.feed(py, now_us, &Event::Timer)
    }

    #[pyo3(signature = (*args, **kwargs), text_signature = "($self, backend, began_us, \
        now_us, *, kv_usage=None, running=None, waiting=None, preemptions_total=None, \
        kv_blocks=None)")]
    fn scrape_ok(
        &mut self,
        py: Python<'_>,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Py<PyAny>> {
        const SCRAPE_OK: Signature = Signature {
            full_name: "Runtime.scrape_ok()",
            positional: &["backend", "began_us", "now_us"],
            optional: 0,
            keyword_only: METRICS,
        };
        let a = SCRAPE_OK.bind(args, kwargs)?;
        let (backend, began_us, now_us): (&str, u64, u64) = (a.get(0)?, a.get(1)?, a.get(2)?);
        let m = Metrics::from_args(&a, 3)?;
        let event = Event::ScrapeOk {
            backend: self.backend(backend)?,
            began_us,
            kv_usage: m.kv_usage,
            running: m.running,
            waiting: m.waiting,
            preemptions_total: m.preemptions_total,
            kv_blocks: m.kv_blocks,
        };
        self.feed(py, now_us, &event)
    }

    #[pyo3(signature = (backend, now_us, *, reachable=false))]
    fn scrape_failed(
        &mut self,
        py: Python<'_>,
        backend: &str,
        now_us: u64,
        reachable: bool,
    ) -> PyResult<Py<PyAny>> {
        let event = Event::ScrapeFailed {
            backend: self.backend(backend)?,
            reachable,
        };
        self.feed(py, now_us, &event)
    }

    #[pyo3(signature = (backend, elsewhere, now_us, *, waiting=0.0, waiting_before=0.0))]
    fn shared_load(
        &mut self,
        py: Python<'_>,
        backend: &str,
        elsewhere: u32,
        now_us: u64,
        waiting: f64,
        waiting_before: f64,
    ) -> PyResult<Py<PyAny>> {
        let event = Event::SharedLoad {
            backend: self.backend(backend)?,
            elsewhere,
            waiting,
            waiting_before,
        };
        self.feed(py, now_us, &event)
    }

    /// The weight of the tenants with requests waiting here (for the other replicas).
    #[getter]
    fn waiting_weight(&self) -> f64 {
        self.core().runtime().governor().waiting_weight()
    }

    fn shared_service(
        &mut self,
        py: Python<'_>,
        tenant: &str,
        cost: f64,
        now_us: u64,
    ) -> PyResult<Py<PyAny>> {
        let tenant = self.core().runtime().governor().tenant_id(tenant)?;
        self.feed(py, now_us, &Event::SharedService { tenant, cost })
    }

    fn shared_usage(
        &mut self,
        py: Python<'_>,
        tenant: &str,
        requests: f64,
        tokens: f64,
        now_us: u64,
    ) -> PyResult<Py<PyAny>> {
        let tenant = self.core().runtime().governor().tenant_id(tenant)?;
        let event = Event::SharedUsage {
            tenant,
            requests,
            tokens,
        };
        self.feed(py, now_us, &event)
    }

    fn lease_denied(
        &mut self,
        py: Python<'_>,
        request_id: u64,
        now_us: u64,
    ) -> PyResult<Py<PyAny>> {
        self.feed(py, now_us, &Event::LeaseDenied { id: request_id })
    }

    fn lease_granted(
        &mut self,
        py: Python<'_>,
        request_id: u64,
        now_us: u64,
    ) -> PyResult<Py<PyAny>> {
        self.feed(py, now_us, &Event::LeaseGranted { id: request_id })
    }

    fn lease_failed(
        &mut self,
        py: Python<'_>,
        request_id: u64,
        now_us: u64,
    ) -> PyResult<Py<PyAny>> {
        self.feed(py, now_us, &Event::LeaseFailed { id: request_id })
    }

    fn store_lost(&mut self, py: Python<'_>, now_us: u64) -> PyResult<Py<PyAny>> {
        self.feed(py, now_us, &Event::StoreLost)
    }

    #[pyo3(signature = (backend, live, now_us, *, waiting=0.0, waiting_before=0.0))]
    fn store_synced(
        &mut self,
        py: Python<'_>,
        backend: &str,
        live: u32,
        now_us: u64,
        waiting: f64,
        waiting_before: f64,
    ) -> PyResult<Py<PyAny>> {
        let event = Event::StoreSynced {
            backend: self.backend(backend)?,
            live,
            waiting,
            waiting_before,
        };
        self.feed(py, now_us, &event)
    }

    /// The leases this replica holds, by backend name (each sync renews them); empty without
    /// a shared store.
    fn leases_held(&self) -> Vec<(String, Vec<u64>)> {
        let core = self.core();
        let gov = core.runtime().governor();
        (0_u32..)
            .zip(core.runtime().leases_held())
            .map(|(b, ids)| (gov.backend_name(b).to_owned(), ids))
            .collect()
    }

    fn drain(&mut self, py: Python<'_>, now_us: u64) -> PyResult<Py<PyAny>> {
        self.feed(py, now_us, &Event::Drain)
    }

    /// The host has carried out every action it was handed: the native front's `Start`s that
    /// waited for its aborts to reach their sockets go upstream now.
    fn carried(&self) {
        self.core().python_carried();
    }

    /// The trace lines recorded since the last call (the header first), or "" when not tracing.
    fn take_trace(&mut self) -> String {
        self.core().take_trace()
    }

    #[getter]
    fn tracing(&self) -> bool {
        self.core().tracing()
    }

    fn next_timer_us(&self) -> Option<u64> {
        self.core().runtime().next_timer_us()
    }

    #[getter]
    fn live(&self) -> usize {
        self.core().runtime().live()
    }

    fn is_live(&self, request_id: u64) -> bool {
        self.core().runtime().is_live(request_id)
    }

    #[getter]
    fn running(&self) -> u32 {
        self.core().runtime().governor().running()
    }

    #[getter]
    fn queued(&self) -> usize {
        self.core().runtime().governor().queued()
    }

    #[getter]
    fn kv_blocks_in_use(&self) -> u64 {
        self.core().runtime().governor().ledger.total_blocks()
    }

    #[getter]
    fn shed_level(&self) -> u8 {
        self.core().runtime().governor().shed_level()
    }

    /// (arrivals known as a client's retry, requests that went to a late lane), so far.
    #[getter]
    fn late_counts(&self) -> (u64, u64) {
        let core = self.core();
        let c = &core.runtime().governor().counters;
        (c.retries_known, c.late)
    }

    #[getter]
    fn draining(&self) -> bool {
        self.core().runtime().governor().draining
    }

    fn backend_healthy(&self, backend: &str) -> PyResult<bool> {
        let id = self.backend(backend)?;
        Ok(self.core().runtime().backend_healthy(id))
    }

    fn scrape_failures(&self, backend: &str) -> PyResult<u32> {
        let id = self.backend(backend)?;
        Ok(self.core().runtime().scrape_failures(id))
    }

    fn request_kv(&self, request_id: u64, now_us: u64) -> Option<(u64, f64)> {
        self.core()
            .runtime()
            .governor()
            .ledger
            .usage(request_id, now_us)
    }

    fn tenant_service(&self, tenant: &str) -> PyResult<f64> {
        let core = self.core();
        let gov = core.runtime().governor();
        Ok(gov.tenant_service(gov.tenant_id(tenant)?))
    }

    fn tenant_usage(&self, tenant: &str) -> PyResult<(f64, f64)> {
        let core = self.core();
        let gov = core.runtime().governor();
        Ok(gov.tenant_usage(gov.tenant_id(tenant)?))
    }

    fn snapshot<'py>(&self, py: Python<'py>, now_us: u64) -> PyResult<Bound<'py, PyAny>> {
        snapshot_to_py(py, &self.core().runtime().governor().snapshot(now_us))
    }

    fn __copy__(&self) -> Self {
        Self {
            shared: Hosted::new(self.core().runtime().clone(), None).shared(),
        }
    }
}

/// Replay a trace's events and check every action; returns (events, actions) replayed.
#[pyfunction]
pub fn replay_trace(text: &str) -> PyResult<(u64, u64)> {
    match trace::replay(text) {
        Ok(done) => Ok((done.events, done.actions)),
        Err(trace::ReplayError::Mismatch(m)) => Err(TraceMismatchError::new_err(m.to_string())),
        Err(err @ trace::ReplayError::Format { .. }) => {
            Err(InvalidArgumentError::new_err(err.to_string()))
        }
    }
}
