"""Where the config file holds each value the core reads by its own name.

`Settings.to_core` and `to_runtime` (`llmflow.config`) read the file through these tables, and an
error the core reports about one of its keys (`llmflow._core.config_problem`) is raised as a
pydantic error at the file's own path, so a user reads the key they wrote.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

if TYPE_CHECKING:
    from llmflow.config import Settings

__all__ = ["CORE_KNOBS", "CORE_SIGNALS", "CORE_SIZES", "LIFECYCLE", "core_error", "value_at"]

# Where the file holds each value the core reads by its own name: `to_core` and `to_runtime`
# read the file through these tables, and a core error about a key is reported at its path.
# (Lists and maps keep their layout: the core's `tiers[2].shed_at` is the file's
# `tiers.2.shed_at`, `models.fast` is `models.fast`; see `_file_loc`.)
CORE_SIZES: dict[str, tuple[str, ...]] = {
    "block_size": ("kv", "block_size"),
    "max_concurrency_per_gpu": ("gate", "max_concurrency_per_gpu"),
    "max_waiting": ("gate", "queue", "max_waiting"),
    "strategy": ("gate", "queue", "strategy"),
}
CORE_KNOBS: dict[str, tuple[str, ...]] = {
    "kv_pressure_threshold": ("kv", "pressure_threshold"),
    "ttft_sla_ms": ("sla", "ttft_ms"),
    "prefill_tokens_per_s": ("sla", "prefill_tokens_per_s"),
    "preemption_cooldown_ms": ("preemption", "cooldown_ms"),
    "queue_timeout_ms": ("gate", "queue", "max_wait_ms"),
    "queue_follows_drain": ("gate", "queue", "follow_drain"),
    "late_yields": ("sla", "late_requests_yield"),
    "first_token_timeout_ms": ("streaming", "first_token_timeout_ms"),
    "request_timeout_ms": ("timeouts", "total_ms"),
    "stale_after_ms": ("metrics", "stale_after_ms"),
    "input_token_weight": ("kv", "input_token_weight"),
    "output_token_weight": ("kv", "output_token_weight"),
    "kv_weight": ("kv", "kv_weight"),
    "kv_fit_target": ("kv", "fit_target"),
    "headroom_quantile": ("gate", "headroom_quantile"),
    "headroom_wait_ms": ("gate", "headroom_wait_ms"),
    "tpot_target_ms": ("gate", "tpot_target_ms"),
}
CORE_SIGNALS: dict[str, tuple[str, ...]] = {  # the core's `signals` section
    "retries": ("signals", "retry_headers"),
    "max_retries": ("signals", "max_retry_count"),
    "deadlines": ("signals", "deadline_headers"),
    "min_deadline_ms": ("signals", "min_deadline_ms"),
}
LIFECYCLE: dict[str, tuple[str, ...]] = {
    "stall_timeout_ms": ("backpressure", "stall_timeout_ms"),
    "drain_timeout_ms": ("server", "drain_timeout_ms"),
}
CORE_PATHS = {
    **CORE_SIZES,
    **CORE_KNOBS,
    **{f"signals.{key}": path for key, path in CORE_SIGNALS.items()},
    **{f"lifecycle.{key}": path for key, path in LIFECYCLE.items()},
}
_ENTRY = re.compile(r"^(backends|tiers|tenants)\[(\d+)\](?:\.(\w+))?(?:\[(\d+)\])?$")
Loc = tuple[str | int, ...]


def value_at(settings: Settings, path: Loc) -> Any:
    value: Any = settings
    for part in path:
        if isinstance(part, int) or isinstance(value, dict):
            value = value[part]
        else:
            value = getattr(value, part)
    return value


def _file_loc(settings: Settings, key: str) -> Loc:
    """Where in the file the core's `key` is: the path a pydantic error would name."""
    if key in CORE_PATHS:
        return CORE_PATHS[key]
    if entry := _ENTRY.match(key):
        section, index, field, item = entry.groups()
        if section == "tenants" and int(index) >= len(settings.tenants):
            return ("default_tier",)  # the anonymous tenant `to_core` adds
        loc: Loc = (section, int(index))
        loc += (field,) if field else ()
        return loc + ((int(item),) if item else ())
    for prefix in ("models.", "routing.pools.", "routing."):
        if key.startswith(prefix):  # a model's name may hold dots: it is the rest, whole
            return (*prefix.rstrip(".").split("."), key.removeprefix(prefix))
    return (key,) if key in ("backends", "tiers", "tenants", "models") else ()


def core_error(settings: Settings, key: str, message: str) -> ValidationError:
    loc = _file_loc(settings, key)
    try:
        value = value_at(settings, loc)
    except (AttributeError, IndexError, KeyError):
        value = None
    if key != ".".join(map(str, loc)) and loc != ("default_tier",):  # as the core names it
        message = f"{message} [core key `{key}`]"
    problem = PydanticCustomError("core_config", "{detail}", {"detail": message})
    detail = InitErrorDetails(type=problem, loc=loc, input=value)
    return ValidationError.from_exception_data("Settings", [detail])
