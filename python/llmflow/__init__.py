"""llmflow: a traffic governor for self-hosted LLM inference in front of vLLM.

The policy (admission, fair queueing, KV-cache accounting) lives in the Rust core
`llmflow._core`; the simulator (`llmflow.sim`) and the gateway (`llmflow.gateway`) both drive it.
"""

from llmflow._core import (
    Admission,
    ConfigError,
    Decision,
    DuplicateRequestError,
    Expired,
    Governor,
    InvalidArgumentError,
    PolicyError,
    UnknownBackendError,
    UnknownTenantError,
    __version__,
    kv_bytes_per_token,
    kv_slots,
)

__all__ = [
    "Admission",
    "ConfigError",
    "Decision",
    "DuplicateRequestError",
    "Expired",
    "Governor",
    "InvalidArgumentError",
    "PolicyError",
    "UnknownBackendError",
    "UnknownTenantError",
    "__version__",
    "kv_bytes_per_token",
    "kv_slots",
]
