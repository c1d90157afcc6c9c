//! Errors of the policy core. Decisions (admit, queue, reject) are values, never errors: these
//! are for misuse — a bad config, an unknown name, an argument out of range.

use std::fmt;

/// Everything the core can refuse to do.
#[derive(Debug, Clone, PartialEq)]
pub enum PolicyError {
    /// A config key has a bad value: the key, the value and what is allowed.
    Config {
        key: String,
        message: String,
    },
    UnknownTenant(String),
    UnknownBackend(String),
    /// A model no backend serves and no alias names, and the names that are served.
    UnknownModel(String, Vec<String>),
    /// No model named while several pools exist, and their names.
    ModelRequired(Vec<String>),
    DuplicateRequest(u64),
    InvalidArgument(String),
}

impl PolicyError {
    #[cold]
    pub fn config(key: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Config {
            key: key.into(),
            message: message.into(),
        }
    }

    #[cold]
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::InvalidArgument(message.into())
    }
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Config { key, message } => write!(f, "config key `{key}`: {message}"),
            Self::UnknownTenant(name) => {
                write!(
                    f,
                    "unknown tenant {name:?}: declare it under `tenants` in the config"
                )
            }
            Self::UnknownBackend(name) => {
                write!(
                    f,
                    "unknown backend {name:?}: declare it under `backends` in the config"
                )
            }
            Self::UnknownModel(name, served) => {
                write!(
                    f,
                    "The model `{name}` does not exist. Served models and aliases: {served:?}"
                )
            }
            Self::ModelRequired(served) => {
                write!(
                    f,
                    "this gateway serves several models; name one in `model`: {served:?}"
                )
            }
            Self::DuplicateRequest(id) => {
                write!(
                    f,
                    "request id {id} is still live; ids must be unique among live requests"
                )
            }
            Self::InvalidArgument(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for PolicyError {}

pub type PolicyResult<T> = Result<T, PolicyError>;
