"""llmflow: a traffic governor for self-hosted LLM inference in front of vLLM.

The policy (admission, fair queueing, KV-cache accounting) and the request lifecycle around it
(`Runtime`: events in, actions out) live in the Rust core `llmflow._core`; the simulator
(`llmflow.sim`) and the gateway (`llmflow.gateway`) are both its hosts.
"""

from typing import TypeAlias

from llmflow._core import (
    Admission,
    Admitted,
    ConfigError,
    DuplicateRequestError,
    Expired,
    Governor,
    InvalidArgumentError,
    PolicyError,
    Queued,
    Rejected,
    Runtime,
    TraceMismatchError,
    UnknownBackendError,
    UnknownModelError,
    UnknownTenantError,
    __version__,
    kv_bytes_per_token,
    kv_slots,
    replay_trace,
)

Decision: TypeAlias = Admitted | Queued | Rejected
"""What `Governor.submit` decided; `match` on the class (`case Admitted(): ...`)."""

__all__ = [
    "Admission",
    "Admitted",
    "ConfigError",
    "Decision",
    "DuplicateRequestError",
    "Expired",
    "Governor",
    "InvalidArgumentError",
    "PolicyError",
    "Queued",
    "Rejected",
    "Runtime",
    "TraceMismatchError",
    "UnknownBackendError",
    "UnknownModelError",
    "UnknownTenantError",
    "__version__",
    "kv_bytes_per_token",
    "kv_slots",
    "replay_trace",
]
