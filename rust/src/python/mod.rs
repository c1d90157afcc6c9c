//! The PyO3 seam, `llmflow._core`: thin wrappers that convert arguments and delegate to the
//! domain types; the only code in the crate that knows Python.
//!
//! Per-request calls take microseconds and keep the GIL; only construction parses JSON.
//! `governor` wraps the `Governor` (its answers in `decisions`), `runtime` the sans-IO
//! `Runtime` (its actions in `actions`), `light` the light lane, `relay` the per-chunk relay,
//! `front` the front door, `tally` the per-request counts and the access log, and `front_checks` the native front's pure checks (a test seam);
//! `errors` maps the core's errors to exceptions, `convert` turns snapshots into plain
//! Python objects, `functions` holds the module's free functions, and `signature` binds the
//! arguments of the methods with more parameters than a Rust function should take.

mod actions;
mod convert;
mod decisions;
mod errors;
#[cfg(feature = "relay")]
mod front;
#[cfg(feature = "relay")]
mod front_checks;
mod functions;
mod governor;
mod light;
#[cfg(feature = "relay")]
mod native;
#[cfg(feature = "relay")]
mod relay;
mod runtime;
mod signature;
#[cfg(feature = "relay")]
mod tally;

pub(crate) use errors::*;

#[pyo3::pymodule(gil_used = true)]
pub mod _core {
    #[pymodule_export]
    use super::actions::{PyAbort, PyArm, PyCut, PyEnd, PyReply, PySetHealth, PyStart, PyWait};
    #[pymodule_export]
    use super::actions::{PyLease, PyRelease};
    #[pymodule_export]
    use super::decisions::{PyAdmission, PyAdmitted, PyExpired, PyQueued, PyRejected};
    #[pymodule_export]
    use super::errors::{
        ConfigError, DuplicateRequestError, InvalidArgumentError, PolicyError, TraceMismatchError,
        UnknownBackendError, UnknownModelError, UnknownTenantError,
    };
    #[pymodule_export]
    use super::functions::{config_problem, kv_bytes_per_token, kv_slots, prefix_hashes};
    #[pymodule_export]
    use super::governor::PyGovernor;
    #[pymodule_export]
    use super::light::{PyLightLane, PyLightRefusal};
    #[pymodule_export]
    use super::runtime::{replay_trace, PyRuntime};

    #[cfg(feature = "relay")]
    #[pymodule_export]
    use super::front::PyFront;
    #[cfg(feature = "relay")]
    #[pymodule_export]
    use super::functions::json_refusal;
    #[cfg(feature = "relay")]
    #[pymodule_export]
    use super::native::PyNativeRoutes;
    #[cfg(feature = "relay")]
    #[pymodule_export]
    use super::relay::PyRelay;
    #[cfg(feature = "relay")]
    #[pymodule_export]
    use super::tally::{request_outcome, shadow_summary, PyTally};

    #[cfg(feature = "relay")]
    #[pymodule_export]
    use super::front_checks::{
        front_cut_frame, front_cut_names_itself, front_foreign_request, front_in_band_error,
        front_merge_frames, front_refusal_bytes, front_signals, front_stream_frames,
        front_trace_sampled, front_traceparent, front_whole_reply, PyFrontChecks, PyFrontKeys,
        PyFrontPrepared,
    };

    #[pymodule_init]
    fn init(m: &pyo3::Bound<'_, pyo3::types::PyModule>) -> pyo3::PyResult<()> {
        use pyo3::types::PyModuleMethods;
        m.add("__version__", env!("CARGO_PKG_VERSION"))
    }
}
