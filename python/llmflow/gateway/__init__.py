"""The llmflow gateway: an OpenAI-compatible streaming front for vLLM, governed by the core.

Every admission, queueing, shedding, priority and deadline decision comes from
`llmflow._core.Governor`; this package only moves bytes, measures, and carries decisions out.
"""

from llmflow.gateway.app import create_app

__all__ = ["create_app"]
