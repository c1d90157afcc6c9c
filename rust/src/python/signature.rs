//! Arguments bound by hand, for the methods whose Python signature has more parameters than a
//! Rust function should take (`Runtime.arrive`, `Runtime.scrape_ok`, `Governor.submit`,
//! `Governor.observe_backend`, `Relay()`): the method takes `*args, **kwargs`
//! and one `Signature` binds them by PyO3's own rules, in its order (the call's shape first,
//! then each argument converted in turn), with its messages, so Python sees the same method
//! as before (`text_signature` keeps `inspect.signature` and the stubs true).

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple};

/// A method's parameters: positional-or-keyword ones (the last `optional` of them with a
/// default, the others required), then keyword-only ones, each with a default.
pub(super) struct Signature {
    /// `Class.method()`, as the errors name it.
    pub full_name: &'static str,
    pub positional: &'static [&'static str],
    pub optional: usize,
    pub keyword_only: &'static [&'static str],
}

/// A call's arguments bound to a signature's parameters, by index (positional first): those
/// given positionally are read from the call's tuple in place; only keyword arguments are
/// kept apart (no allocation for a call that names none, the hot path).
pub(super) struct Args<'a, 'py> {
    signature: &'static Signature,
    positional: &'a Bound<'py, PyTuple>,
    /// By parameter index, from `positional.len()` on: the values keywords gave.
    named: Vec<Option<Bound<'py, PyAny>>>,
}

impl Signature {
    pub fn bind<'a, 'py>(
        &'static self,
        args: &'a Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Args<'a, 'py>> {
        let positional = self.positional.len();
        let given = args.len();
        let required = positional - self.optional;
        if given > positional {
            let was = if given == 1 { "was" } else { "were" };
            let takes = if self.optional == 0 {
                format!("{positional}")
            } else {
                format!("from {required} to {positional}")
            };
            return Err(PyTypeError::new_err(format!(
                "{} takes {takes} positional arguments but {given} {was} given",
                self.full_name
            )));
        }
        let mut named: Vec<Option<Bound<'py, PyAny>>> = Vec::new();
        for (key, value) in kwargs.iter().flat_map(|k| PyDictMethods::iter(*k)) {
            let name = key.cast::<PyString>()?.to_str()?;
            let index = self
                .positional
                .iter()
                .chain(self.keyword_only)
                .position(|p| *p == name);
            match index {
                Some(i) if i < given => {
                    return Err(PyTypeError::new_err(format!(
                        "{} got multiple values for argument '{name}'",
                        self.full_name
                    )));
                }
                Some(i) => {
                    if named.is_empty() {
                        named.resize(positional + self.keyword_only.len() - given, None);
                    }
                    named[i - given] = Some(value);
                }
                None => {
                    return Err(PyTypeError::new_err(format!(
                        "{} got an unexpected keyword argument '{name}'",
                        self.full_name
                    )));
                }
            }
        }
        let missing: Vec<&str> = (given..required)
            .filter(|&i| named.get(i - given).is_none_or(Option::is_none))
            .map(|i| self.positional[i])
            .collect();
        if !missing.is_empty() {
            return Err(PyTypeError::new_err(missing_message(
                self.full_name,
                &missing,
            )));
        }
        Ok(Args {
            signature: self,
            positional: args,
            named,
        })
    }

    fn name(&self, index: usize) -> &'static str {
        let positional = self.positional.len();
        if index < positional {
            self.positional[index]
        } else {
            self.keyword_only[index - positional]
        }
    }
}

impl<'py> Args<'_, 'py> {
    /// The value of parameter `index` (a required positional one, always bound), converted.
    pub fn get<'b, T>(&'b self, index: usize) -> PyResult<T>
    where
        T: FromPyObject<'b, 'py>,
    {
        self.get_or_none(index).expect("bound: checked in `bind`")
    }

    /// The value of parameter `index` (one with a default), or `default` when the call left
    /// it out.
    pub fn get_or<'b, T>(&'b self, index: usize, default: T) -> PyResult<T>
    where
        T: FromPyObject<'b, 'py>,
    {
        self.get_or_none(index).unwrap_or(Ok(default))
    }

    fn get_or_none<'b, T>(&'b self, index: usize) -> Option<PyResult<T>>
    where
        T: FromPyObject<'b, 'py>,
    {
        let given = self.positional.len();
        if index < given {
            let value = self.positional.get_borrowed_item(index);
            return Some(value.and_then(|v| self.convert(index, v)));
        }
        let value = self.named.get(index - given)?.as_ref()?;
        Some(self.convert(index, value.as_borrowed()))
    }

    fn convert<'b, T>(&self, index: usize, value: Borrowed<'b, 'py, PyAny>) -> PyResult<T>
    where
        T: FromPyObject<'b, 'py>,
    {
        convert(self.signature.name(index), value)
    }
}

/// An argument converted as PyO3 converts one: a TypeError names the argument.
fn convert<'b, 'py, T>(name: &str, value: Borrowed<'b, 'py, PyAny>) -> PyResult<T>
where
    T: FromPyObject<'b, 'py>,
{
    value.extract::<T>().map_err(|e| {
        let err: PyErr = e.into();
        let py = value.py();
        if err.get_type(py).is(py.get_type::<PyTypeError>()) {
            let named = PyTypeError::new_err(format!("argument '{name}': {}", err.value(py)));
            named.set_cause(py, err.cause(py));
            named
        } else {
            err
        }
    })
}

/// What a scrape read: the keyword-only parameters `Runtime.scrape_ok` and
/// `Governor.observe_backend` share, from index `first` of their signature on.
pub(super) const METRICS: &[&str] = &[
    "kv_usage",
    "running",
    "waiting",
    "preemptions_total",
    "kv_blocks",
];

pub(super) struct Metrics {
    pub kv_usage: Option<f64>,
    pub running: Option<u64>,
    pub waiting: Option<u64>,
    pub preemptions_total: Option<u64>,
    pub kv_blocks: Option<u64>,
}

impl Metrics {
    pub fn from_args(a: &Args<'_, '_>, first: usize) -> PyResult<Self> {
        Ok(Self {
            kv_usage: a.get_or(first, None)?,
            running: a.get_or(first + 1, None)?,
            waiting: a.get_or(first + 2, None)?,
            preemptions_total: a.get_or(first + 3, None)?,
            kv_blocks: a.get_or(first + 4, None)?,
        })
    }
}

/// "f() missing 2 required positional arguments: 'a' and 'b'" (three or more: "'a', 'b', and
/// 'c'"), as CPython and PyO3 word it.
fn missing_message(full_name: &str, names: &[&str]) -> String {
    let plural = if names.len() == 1 {
        "argument"
    } else {
        "arguments"
    };
    let mut msg = format!(
        "{full_name} missing {} required positional {plural}: ",
        names.len()
    );
    for (i, name) in names.iter().enumerate() {
        if i != 0 {
            if names.len() > 2 {
                msg.push(',');
            }
            msg.push_str(if i == names.len() - 1 { " and " } else { " " });
        }
        msg.push('\'');
        msg.push_str(name);
        msg.push('\'');
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::missing_message;

    // The list reads as CPython's: one name, two joined by "and", more with commas too.
    #[test]
    fn missing_names_read_as_python_words_them() {
        assert_eq!(
            missing_message("f()", &["a"]),
            "f() missing 1 required positional argument: 'a'"
        );
        assert_eq!(
            missing_message("f()", &["a", "b"]),
            "f() missing 2 required positional arguments: 'a' and 'b'"
        );
        assert_eq!(
            missing_message("f()", &["a", "b", "c"]),
            "f() missing 3 required positional arguments: 'a', 'b', and 'c'"
        );
    }
}
