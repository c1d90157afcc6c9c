//! The module's free functions: prefix hashes and the capacity formulas.

use pyo3::prelude::*;

use crate::capacity;

/// The chained block hashes of a prompt's bytes (`routing::chain_hashes`), for a host that has
/// no tokens to hash; `keyed`: under this process's random key (`routing::keyed_chain_hashes`),
/// as the gateway hashes clients' prompts. A per-request call: it keeps the GIL (microseconds
/// for 100 KB).
#[pyfunction]
#[pyo3(signature = (data, chunk, max_blocks=4096, keyed=false))]
pub fn prefix_hashes(data: &[u8], chunk: usize, max_blocks: usize, keyed: bool) -> Vec<u64> {
    if keyed {
        crate::routing::keyed_chain_hashes(data, chunk, max_blocks)
    } else {
        crate::routing::chain_hashes(data, chunk, max_blocks)
    }
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

/// The first problem the core finds in a runtime config (the mapping `Runtime` takes), as
/// `(key, message)` in the core's own key names, or None when `Runtime(config)` would build.
/// `llmflow.config` asks it for every file it loads, so the core is the one validator of every
/// value it is built from.
#[pyfunction]
pub fn config_problem(
    py: Python<'_>,
    config: &Bound<'_, PyAny>,
) -> PyResult<Option<(String, String)>> {
    if !config.is_instance_of::<pyo3::types::PyDict>() {
        return Err(super::errors::ConfigError::new_err(format!(
            "config must be a mapping (dict), got {}",
            config.get_type().name()?
        )));
    }
    let json = py.import("json")?.call_method1("dumps", (config,))?;
    match crate::runtime::RuntimeConfig::check_json(json.extract()?) {
        Ok(()) => Ok(None),
        Err(crate::error::PolicyError::Config { key, message }) => Ok(Some((key, message))),
        Err(other) => Err(other.into()),
    }
}

/// `decode_json`'s 400 for a body that is not one JSON object of finite numbers: the message
/// the front answers natively (`front::decode`), so the app's refusal is worded by the same
/// parser at the same line and column whatever pydantic-core's own jiter is. None: the body is
/// one such object.
#[cfg(feature = "relay")]
#[pyfunction]
pub fn json_refusal(raw: &[u8]) -> Option<String> {
    crate::front::decode::refusal(raw)
}
