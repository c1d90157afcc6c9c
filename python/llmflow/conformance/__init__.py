"""`llmflow conformance`: llmflow's invariants, checked from outside against any gateway.

The suite starts an instrumented fake vLLM (`backend.py`, its replies in `frames.py`; or reads
a standing one through `remote.py`), which the gateway under test is pointed at; drives the
gateway with the floods, disconnects, stalled clients and tier mixes of llmflow's own tests
(`phases.py`, through `client.py`); judges each invariant from what its clients got and what
the backend saw (`invariants.py`); and prints a pass/fail table (`report.py`). `suite.py`
runs it; `cli.py` is the command.
"""

from __future__ import annotations

from llmflow.conformance.backend import Backend, BackendServer
from llmflow.conformance.report import Row
from llmflow.conformance.suite import Options, SuiteError, run

__all__ = ["Backend", "BackendServer", "Options", "Row", "SuiteError", "run"]
