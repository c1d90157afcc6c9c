"""Hypothesis profiles: `fast` for local edits, `ci` for CI, `nightly` for long searches.

Pick one with `HYPOTHESIS_PROFILE` (default `ci`).
"""

import os

from hypothesis import HealthCheck, settings

_COMMON = {"deadline": None, "print_blob": True}
settings.register_profile("fast", max_examples=25, **_COMMON)
settings.register_profile(
    "ci", max_examples=150, suppress_health_check=[HealthCheck.too_slow], **_COMMON
)
settings.register_profile(
    "nightly", max_examples=5000, suppress_health_check=[HealthCheck.too_slow], **_COMMON
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
