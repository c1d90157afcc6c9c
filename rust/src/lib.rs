//! llmflow's policy core: admission, fair queueing and KV-cache accounting for LLM serving.
//!
//! The domain modules (`governor`, `fair_queue`, `kv`, `backend`, `capacity`) know nothing of
//! Python and read no clock; `py` is the only PyO3 seam.

pub mod backend;
pub mod capacity;
pub mod config;
pub mod error;
pub mod fair_queue;
pub mod governor;
pub mod kv;
pub mod light;
#[cfg(feature = "relay")]
pub mod relay;
pub mod routing;
pub mod runtime;
pub mod snapshot;
pub mod trace;
pub mod types;

#[cfg(feature = "python")]
mod py;
#[cfg(feature = "python")]
mod py_light;
#[cfg(all(feature = "python", feature = "relay"))]
mod py_relay;
#[cfg(feature = "python")]
mod py_runtime;

pub use config::PolicyConfig;
pub use error::{PolicyError, PolicyResult};
pub use governor::{Arrival, Governor, Route};
pub use runtime::{Action, Event, Runtime};
pub use types::{Admission, Decision, Expired, ExpiryReason, Outcome, RejectReason};

#[cfg(feature = "python")]
#[pyo3::pymodule(gil_used = true)]
pub mod _core {
    #[pymodule_export]
    use crate::py::{
        kv_bytes_per_token, kv_slots, prefix_hashes, ConfigError, DuplicateRequestError,
        InvalidArgumentError, PolicyError, PyAdmission, PyAdmitted, PyExpired, PyGovernor,
        PyQueued, PyRejected, TraceMismatchError, UnknownBackendError, UnknownModelError,
        UnknownTenantError,
    };
    #[pymodule_export]
    use crate::py_light::{PyLightLane, PyLightRefusal};
    #[pymodule_export]
    use crate::py_runtime::{
        replay_trace, PyAbort, PyArm, PyCut, PyEnd, PyReply, PyRuntime, PySetHealth, PyStart,
        PyWait,
    };

    #[cfg(feature = "relay")]
    #[pymodule_export]
    use crate::py_relay::PyRelay;

    #[pymodule_init]
    fn init(m: &pyo3::Bound<'_, pyo3::types::PyModule>) -> pyo3::PyResult<()> {
        use pyo3::types::PyModuleMethods;
        m.add("__version__", env!("CARGO_PKG_VERSION"))
    }
}
