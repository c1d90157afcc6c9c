//! Capacity estimates: how many concurrent contexts fit in a GPU's KV cache.

use crate::error::{PolicyError, PolicyResult};

/// The seed's formula: `slots = (VRAM - weights - activations) / (avg_context * kv_bytes_per_token)`.
/// Any consistent unit works (bytes throughout, or GB and GB per token).
pub fn kv_slots(
    vram: f64,
    weights: f64,
    activations: f64,
    avg_context_tokens: f64,
    kv_bytes_per_token: f64,
) -> PolicyResult<f64> {
    for (name, v) in [
        ("vram", vram),
        ("weights", weights),
        ("activations", activations),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            return Err(PolicyError::invalid(format!(
                "{name} must be >= 0, got {v}"
            )));
        }
    }
    for (name, v) in [
        ("avg_context_tokens", avg_context_tokens),
        ("kv_bytes_per_token", kv_bytes_per_token),
    ] {
        if !(v.is_finite() && v > 0.0) {
            return Err(PolicyError::invalid(format!("{name} must be > 0, got {v}")));
        }
    }
    Ok(((vram - weights - activations) / (avg_context_tokens * kv_bytes_per_token)).max(0.0))
}

/// KV bytes one token takes on one GPU: keys and values for every layer's KV heads, split over
/// `tp` tensor-parallel GPUs.
pub fn kv_bytes_per_token(
    layers: u64,
    kv_heads: u64,
    head_dim: u64,
    dtype_bytes: u64,
    tp: u64,
) -> PolicyResult<u64> {
    if [layers, kv_heads, head_dim, dtype_bytes, tp].contains(&0) {
        return Err(PolicyError::invalid(
            "layers, kv_heads, head_dim, dtype_bytes and tp must all be >= 1",
        ));
    }
    Ok((2 * layers * kv_heads * head_dim * dtype_bytes).div_ceil(tp))
}

#[cfg(test)]
mod tests {
    use super::*;

    // The seed's example: 80 GB A100, 64 GB weights, 6 GB activations, 4,096 tokens x ~1 MB
    // per token leaves room for 2 full contexts (2.4, rounded down by the caller).
    #[test]
    fn seed_example() {
        let slots = kv_slots(80e9, 64e9, 6e9, 4096.0, 1e6).unwrap();
        assert_eq!(slots.floor(), 2.0);
    }

    // Published per-token KV sizes (bf16): Llama-3-8B 128 KiB, Llama-3-70B 320 KiB,
    // Qwen2.5-32B 256 KiB; TP splits them.
    #[test]
    fn model_shapes() {
        assert_eq!(kv_bytes_per_token(32, 8, 128, 2, 1).unwrap(), 128 * 1024);
        assert_eq!(kv_bytes_per_token(80, 8, 128, 2, 1).unwrap(), 320 * 1024);
        assert_eq!(kv_bytes_per_token(64, 8, 128, 2, 1).unwrap(), 256 * 1024);
        assert_eq!(kv_bytes_per_token(80, 8, 128, 2, 4).unwrap(), 80 * 1024);
    }

    // Weights larger than memory give zero slots, not a negative number; bad inputs error.
    #[test]
    fn edge_cases() {
        assert_eq!(kv_slots(10.0, 20.0, 0.0, 1.0, 1.0).unwrap(), 0.0);
        assert!(kv_slots(10.0, 1.0, 0.0, 0.0, 1.0).is_err());
        assert!(kv_bytes_per_token(0, 8, 128, 2, 1).is_err());
    }
}
