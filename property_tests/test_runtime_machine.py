"""The runtime state machine (`llmflow.verify.machine`) over random configs with every check on.

The machine and its reference model live in the package, so `llmflow config verify` runs the
same checks on a user's own config; here they explore `runtime_strategies.runtime_configs()`.
"""

from __future__ import annotations

from hypothesis import settings

from llmflow.verify.machine import machine_for
from property_tests.runtime_strategies import runtime_configs

RuntimeMachine = machine_for(runtime_configs())
RuntimeMachine.TestCase.settings = settings(stateful_step_count=100)
TestRuntimeMachine = RuntimeMachine.TestCase
