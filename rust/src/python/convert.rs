//! Core values as plain Python objects (a snapshot without a JSON round trip).

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyList, PyString};
use serde_json::Value;

use super::PolicyError;

/// A JSON value as plain Python objects (dict, list, str, int, float, bool, None).
fn to_python<'py>(py: Python<'py>, value: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => u.into_pyobject(py)?.into_any(),
            (None, Some(i)) => i.into_pyobject(py)?.into_any(),
            (None, None) => n.as_f64().into_pyobject(py)?.into_any(),
        },
        Value::String(text) => PyString::new(py, text).into_any(),
        Value::Array(items) => {
            let items = items
                .iter()
                .map(|v| to_python(py, v))
                .collect::<PyResult<Vec<_>>>()?;
            PyList::new(py, items)?.into_any()
        }
        Value::Object(map) => {
            let dict = PyDict::new(py);
            for (key, v) in map {
                dict.set_item(key, to_python(py, v)?)?;
            }
            dict.into_any()
        }
    })
}

/// A governor snapshot as plain Python objects, without a JSON round trip.
pub(crate) fn snapshot_to_py<'py>(
    py: Python<'py>,
    snapshot: &crate::snapshot::Snapshot,
) -> PyResult<Bound<'py, PyAny>> {
    let value = serde_json::to_value(snapshot).map_err(|e| PolicyError::new_err(e.to_string()))?;
    let snapshot = to_python(py, &value)?;
    // Pairs serialise as lists; turn the by-name ones into dicts (in declared order).
    let dict = snapshot.cast::<PyDict>()?;
    pairs_to_dict(dict, "queued_by_tier")?;
    let counters = dict.get_item("counters")?.expect("counters present");
    let counters = counters.cast::<PyDict>()?;
    for key in ["rejected", "finished", "expired"] {
        pairs_to_dict(counters, key)?;
    }
    Ok(snapshot)
}

fn pairs_to_dict(dict: &Bound<'_, PyDict>, key: &str) -> PyResult<()> {
    let Some(pairs) = dict.get_item(key)? else {
        return Ok(());
    };
    let out = PyDict::new(dict.py());
    for pair in pairs.cast::<PyList>()?.iter() {
        let pair = pair.cast::<PyList>()?;
        out.set_item(pair.get_item(0)?, pair.get_item(1)?)?;
    }
    dict.set_item(key, out)
}
