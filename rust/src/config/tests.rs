//! The config's checks, from outside: what a document may say, and the message when it may not.

use super::*;

pub(crate) fn sample_json() -> String {
    r#"{"backends":[{"name":"b0","gpus":1,"kv_blocks":1000}],
        "max_concurrency_per_gpu":2,"max_waiting":4,
        "tiers":[{"name":"vip","protected":true},{"name":"normal","shed_at":0.5},
                 {"name":"batch","shed_at":0.5,"max_share":0.5}],
        "tenants":[{"name":"v","tier":"vip"},{"name":"a","tier":"normal"},
                   {"name":"b","tier":"normal"},{"name":"z","tier":"batch"}],
        "kv_pressure_threshold":0.85,"ttft_sla_ms":1500,"preemption_cooldown_ms":1000,
        "queue_timeout_ms":5000,"first_token_timeout_ms":3000,"request_timeout_ms":60000}"#
        .to_string()
}

// The sample used across the crate's tests parses and validates.
#[test]
fn sample_is_valid() {
    let c = PolicyConfig::from_json(&sample_json()).unwrap();
    assert_eq!(c.tiers.len(), 3);
    assert_eq!(c.strategy, Strategy::Fair);
}

// An unknown key is refused with its name, so typos do not silently fall back to defaults.
#[test]
fn unknown_key_is_named() {
    let text = sample_json().replace("\"max_waiting\"", "\"max_wating\"");
    let err = PolicyConfig::from_json(&text).unwrap_err().to_string();
    assert!(err.contains("max_wating"), "{err}");
}

// A tenant pointing at a missing tier names the key and the allowed tiers.
#[test]
fn tenant_tier_must_exist() {
    let text = sample_json().replace(r#""tier":"batch""#, r#""tier":"gold""#);
    let err = PolicyConfig::from_json(&text).unwrap_err().to_string();
    assert!(
        err.contains("tenants[3].tier") && err.contains("vip"),
        "{err}"
    );
}

// shed_at must not rise down the tier list, or VIP could be shed before normal.
#[test]
fn shed_at_must_not_increase() {
    let text = sample_json().replace(
        r#"{"name":"vip","protected":true}"#,
        r#"{"name":"vip","protected":true,"shed_at":0.4}"#,
    );
    let err = PolicyConfig::from_json(&text).unwrap_err().to_string();
    assert!(err.contains("tiers[1].shed_at"), "{err}");
}

// Backends must all declare their models or none; an alias must point at a served model.
#[test]
fn models_are_declared_consistently() {
    let two = sample_json().replace(
        r#"[{"name":"b0","gpus":1,"kv_blocks":1000}]"#,
        r#"[{"name":"b0","models":["m"]},{"name":"b1"}]"#,
    );
    let err = PolicyConfig::from_json(&two).unwrap_err().to_string();
    assert!(err.contains("backends[1].models"), "{err}");
    let alias = sample_json().replace(
        r#"[{"name":"b0","gpus":1,"kv_blocks":1000}]"#,
        r#"[{"name":"b0","models":["m"]}],"models":{"fast":"n"}"#,
    );
    let err = PolicyConfig::from_json(&alias).unwrap_err().to_string();
    assert!(
        err.contains("models.fast") && err.contains(r#"["m"]"#),
        "{err}"
    );
    let pool = sample_json().replace(
        r#"[{"name":"b0","gpus":1,"kv_blocks":1000}]"#,
        r#"[{"name":"b0","models":["m"]}],"routing":{"pools":{"x":"prefix"}}"#,
    );
    let err = PolicyConfig::from_json(&pool).unwrap_err().to_string();
    assert!(err.contains("routing.pools.x"), "{err}");
}

// Thresholds outside (0, 1] are refused with the value.
#[test]
fn fraction_range() {
    let text = sample_json().replace("0.85", "1.5");
    let err = PolicyConfig::from_json(&text).unwrap_err().to_string();
    assert!(
        err.contains("kv_pressure_threshold") && err.contains("1.5"),
        "{err}"
    );
}

// A pool is co-located or split, and a split pool has both kinds; the message names the
// backend to fix. Other models' pools are independent.
#[test]
fn split_pool_config_is_checked() {
    let text = |backends: &str| {
        format!(
            r#"{{"backends":{backends},"tiers":[{{"name":"t"}}],
                "tenants":[{{"name":"a","tier":"t"}}]}}"#
        )
    };
    let error = |backends: &str| {
        crate::Governor::from_json(&text(backends))
            .unwrap_err()
            .to_string()
    };
    let err = error(r#"[{"name":"p","role":"prefill"},{"name":"x"}]"#);
    assert!(
        err.contains("backends[1].role") && err.contains("co-located or split"),
        "{err}"
    );
    let err = error(r#"[{"name":"p","role":"prefill"}]"#);
    assert!(
        err.contains("backends[0].role") && err.contains("no \"decode\""),
        "{err}"
    );
    let err = error(r#"[{"name":"p","role":"pre"}]"#);
    assert!(err.contains("prefill"), "{err}");
    let ok = text(
        r#"[{"name":"p","role":"prefill","models":["m"]},
            {"name":"d","role":"decode","models":["m"]},{"name":"x","models":["n"]}]"#,
    );
    let g = crate::Governor::from_json(&ok).unwrap();
    assert!(g.pools.is_split(0) && !g.pools.is_split(1));
}

// An empty name is reported at its own place, so a loader can point at the entry.
#[test]
fn empty_name_is_named_by_its_place() {
    let text = sample_json().replace(
        r#"{"name":"b","tier":"normal"}"#,
        r#"{"name":"","tier":"normal"}"#,
    );
    let err = PolicyConfig::from_json(&text).unwrap_err().to_string();
    assert!(err.contains("`tenants[2].name`"), "{err}");
}

// The runtime config's check refuses what building a runtime refuses, with the same key: the
// lifecycle's values and the policy's.
#[test]
fn runtime_check_matches_the_runtime() {
    use crate::runtime::{Runtime, RuntimeConfig};
    let policy = sample_json();
    for lifecycle in [r#"{"drain_timeout_ms":-1}"#, r#"{"stall_timeout_ms":5}"#] {
        let text = format!(r#"{{"policy":{policy},"lifecycle":{lifecycle}}}"#);
        let checked = RuntimeConfig::check_json(&text)
            .err()
            .map(|e| e.to_string());
        let built = Runtime::from_json(&text).err().map(|e| e.to_string());
        assert_eq!(checked, built);
    }
    let bad = policy.replace(r#""max_waiting":4"#, r#""max_waiting":4,"block_size":0"#);
    let text = format!(r#"{{"policy":{bad}}}"#);
    let err = RuntimeConfig::check_json(&text).unwrap_err().to_string();
    assert!(err.contains("`block_size`"), "{err}");
    assert!(RuntimeConfig::check_json("{}")
        .unwrap_err()
        .to_string()
        .contains("(document)"));
}
