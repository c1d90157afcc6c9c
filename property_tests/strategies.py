"""Hypothesis strategies shared by the property tests.

Two kinds of governor config: `permissive_configs`, with the optional checks off (no TTFT SLA,
breaker, stale metrics or KV fit), and `strict_configs`, with every one of them on, sized so
that each binds within a few dozen steps (caps of 1-4 slots, 24-160 KV blocks, SLAs of a few
prompts' prefill, stale limits and cool-downs shorter than the time steps).
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

VIPS = ("v1", "v2", "v3")  # the protected tier's tenants
NORMALS = ("n1", "n2")
TENANTS = (*VIPS, *NORMALS, "b1")  # three VIP, two normal, one batch tenant


def policy_config(
    max_waiting: int, per_gpu: int, gpus: tuple[int, ...], **checks: Any
) -> dict[str, Any]:
    """A core config; `checks` overrides the defaults (no SLA, breaker, stale metrics, KV fit)."""
    config = {
        "backends": [{"name": f"b{i}", "gpus": g, "kv_blocks": 0} for i, g in enumerate(gpus)],
        "block_size": 16,
        "max_concurrency_per_gpu": per_gpu,
        "max_waiting": max_waiting,
        "strategy": "fair",
        "tiers": [
            {"name": "vip", "shed_at": 1.0, "max_share": 1.0, "protected": True},
            {"name": "normal", "shed_at": 0.8, "max_share": 1.0, "protected": False},
            {"name": "batch", "shed_at": 0.5, "max_share": 0.5, "protected": False},
        ],
        "tenants": [
            {"name": "v1", "tier": "vip", "weight": 1.0},
            {"name": "v2", "tier": "vip", "weight": 2.0},
            {"name": "v3", "tier": "vip", "weight": 1.0},
            {"name": "n1", "tier": "normal", "weight": 1.0},
            {"name": "n2", "tier": "normal", "weight": 2.0},
            {"name": "b1", "tier": "batch", "weight": 1.0},
        ],
        "kv_pressure_threshold": 0.85,
        "ttft_sla_ms": None,
        "preemption_cooldown_ms": None,
        "queue_timeout_ms": 2000.0,
        "queue_follows_drain": True,
        "first_token_timeout_ms": 3000.0,
        "request_timeout_ms": 10000.0,
        "stale_after_ms": None,
        "prefill_tokens_per_s": 8000.0,
        "input_token_weight": 1.0,
        "output_token_weight": 2.0,
        "kv_weight": 1.0,
    }
    config.update(checks)
    return config


def _strict(backends: list[tuple[int, int]], **checks: Any) -> dict[str, Any]:
    """A config whose backends (GPUs, KV blocks) know their KV capacity, so KV fit applies."""
    config = policy_config(gpus=tuple(gpus for gpus, _ in backends), **checks)
    for backend, (_, blocks) in zip(config["backends"], backends, strict=True):
        backend["kv_blocks"] = blocks
    return config


_sizes = {
    "max_waiting": st.integers(0, 12),
    "per_gpu": st.integers(1, 4),
}
_deadlines = {  # whole milliseconds, so the µs deadlines are exact
    "queue_timeout_ms": st.none() | st.integers(300, 4000).map(float),
    "queue_follows_drain": st.booleans(),
    "first_token_timeout_ms": st.none() | st.integers(300, 4000).map(float),
    "request_timeout_ms": st.none() | st.integers(1000, 15000).map(float),
}
permissive_configs = st.builds(
    policy_config,
    gpus=st.lists(st.integers(1, 2), min_size=1, max_size=2).map(tuple),
    **_sizes,
    **_deadlines,
)
strict_configs = st.builds(
    _strict,
    backends=st.lists(st.tuples(st.integers(1, 2), st.integers(24, 160)), min_size=1, max_size=2),
    kv_pressure_threshold=st.sampled_from([0.6, 0.85, 0.95]),
    ttft_sla_ms=st.integers(100, 2000).map(float),
    prefill_tokens_per_s=st.sampled_from([500.0, 2000.0, 8000.0]),
    preemption_cooldown_ms=st.integers(200, 4000).map(float),
    stale_after_ms=st.integers(300, 3000).map(float),
    input_token_weight=st.sampled_from([0.5, 1.0]),
    output_token_weight=st.sampled_from([1.0, 2.0]),
    kv_weight=st.sampled_from([0.0, 1.0, 3.0]),
    **_sizes,
    **_deadlines,
)
tenants = st.sampled_from(TENANTS)
prompt_tokens = st.integers(0, 200) | st.integers(200, 1500)  # up to 94 blocks of 16
max_tokens = st.integers(1, 600)
time_steps_us = st.integers(0, 1_500_000)


# ---- upstream stream chunks (the native front's whole replies) -----------------------------

# JSON as vLLM's chunks hold it: integers within 64 bits (the relay's reader holds no larger),
# finite floats, any text but lone surrogates.
_JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=8),
    st.floats(allow_nan=False, allow_infinity=False),
)
JSON_VALUES = st.recursive(
    _JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
_TEXT = st.text(max_size=6)
_FINISH = st.sampled_from([None, None, None, "stop", "length", "tool_calls"])
_MAYBE = st.sampled_from([False, False, True])


def _optional(draw: Any, key: str, value: st.SearchStrategy[Any], out: dict[str, Any]) -> None:
    if draw(_MAYBE):
        out[key] = draw(value)


@st.composite
def tool_call_deltas(draw: Any) -> dict[str, Any]:
    """One tool call delta: an index, and some of its id, type, name and argument text."""
    call: dict[str, Any] = {}
    _optional(draw, "index", st.integers(0, 2), call)
    _optional(draw, "id", st.sampled_from(["", "call-1", "call-2"]) | JSON_VALUES, call)
    _optional(draw, "type", st.sampled_from(["function", ""]), call)
    function: dict[str, Any] = {}
    _optional(draw, "name", st.sampled_from(["f", "g", ""]) | JSON_VALUES, function)
    _optional(draw, "arguments", _TEXT | st.none(), function)
    _optional(draw, "function", st.just(function) | st.none(), call)
    return call


@st.composite
def stream_choices(draw: Any, chat: bool) -> dict[str, Any]:
    """One choice of a stream chunk: its text (a delta or `text`), tool calls, reasoning,
    logprobs, token ids, a finish reason, and the fields only some chunks carry."""
    choice: dict[str, Any] = {}
    _optional(draw, "index", st.sampled_from([0, 0, 0, 1]), choice)
    if chat and draw(st.integers(0, 9)) != 0:
        delta: dict[str, Any] = {}
        _optional(draw, "role", st.just("assistant"), delta)
        for key in ("content", "content", "reasoning", "reasoning_content"):
            _optional(draw, key, _TEXT | st.none(), delta)
        _optional(draw, "tool_calls", st.lists(tool_call_deltas(), max_size=2) | st.none(), delta)
        choice["delta"] = draw(st.just(delta) | st.none()) if draw(_MAYBE) else delta
    else:
        _optional(draw, "text", _TEXT | JSON_VALUES, choice)
        choice.setdefault("text", draw(_TEXT))
    logprobs = st.dictionaries(
        st.sampled_from(["content", "tokens", "token_logprobs", "top_logprobs"]),
        st.lists(JSON_VALUES, max_size=2) | JSON_VALUES,
        max_size=2,
    )
    _optional(draw, "logprobs", logprobs | st.none(), choice)
    choice["finish_reason"] = draw(_FINISH)
    _optional(draw, "stop_reason", st.none() | st.integers(0, 9) | _TEXT, choice)
    _optional(draw, "token_ids", st.lists(st.integers(0, 99), max_size=3) | st.none(), choice)
    _optional(draw, "prompt_token_ids", st.lists(st.integers(0, 99), max_size=3), choice)
    _optional(draw, draw(st.sampled_from(["message", "routed_experts", "x"])), JSON_VALUES, choice)
    return choice


@st.composite
def stream_chunks(draw: Any, chat: bool, template: dict[str, Any] | None) -> dict[str, Any]:
    """One upstream chunk: the stream's id/created/model (when it has them), choices or none
    (the usage chunk), continuous usage, and top-level fields (a fingerprint, the marker)."""
    chunk: dict[str, Any] = dict(template) if template is not None and draw(st.booleans()) else {}
    chunk["object"] = "chat.completion.chunk" if chat else "text_completion"
    chunk["choices"] = draw(st.lists(stream_choices(chat), max_size=2))
    usage = st.fixed_dictionaries(
        {"prompt_tokens": st.integers(0, 99), "total_tokens": st.integers(0, 99),
         "completion_tokens": st.integers(0, 99)},
        optional={"prompt_tokens_details": JSON_VALUES, "extra": JSON_VALUES},
    )
    _optional(draw, "usage", usage | st.none(), chunk)
    _optional(draw, "system_fingerprint", _TEXT | st.none(), chunk)
    _optional(draw, draw(st.sampled_from(["service_tier", "metrics", "newer"])), JSON_VALUES, chunk)
    _optional(draw, "llmflow", st.none() | st.fixed_dictionaries(
        {"truncated": st.just(True), "reason": _TEXT}), chunk)
    return chunk


# Chunks the Python fold raises on (or `ChunkParser` refuses): the request fails either way.
BAD_CHUNKS: tuple[Any, ...] = (
    {"choices": 5},
    {"choices": [7]},
    {"choices": [{"delta": "text"}]},
    {"choices": [], "usage": "lots"},
    [1, 2],
    {"choices": [{"index": 0, "delta": {"tool_calls": "call"}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [3]}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"function": {"arguments": 3}}]}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"function": "f"}]}}]},
)
