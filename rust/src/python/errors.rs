//! The core's errors as Python exceptions, and the checks on Python's integers.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

use crate::error::PolicyError as CoreError;

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
