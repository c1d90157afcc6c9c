"""Golden-output collector: every scenario and incident under sim/ is a test.

`sim/scenarios/<name>.yaml` is compared with `<name>.out`, `sim/incidents/<name>.yaml` with
`<name>/expected.out`: the comparison table `llmflow sim run` prints (simulated quantities only).
`LLMFLOW_UPDATE_GOLDENS=1 pytest sim` (`make goldens`) rewrites them; review the diff.
"""

from __future__ import annotations

import difflib
import os
from typing import TYPE_CHECKING, Any

import pytest

from llmflow.sim.report import render_table
from llmflow.sim.runner import run_scenario
from llmflow.sim.scenario import load_scenario

if TYPE_CHECKING:
    from pathlib import Path

_UPDATE = os.environ.get("LLMFLOW_UPDATE_GOLDENS") == "1"


def pytest_collect_file(parent: pytest.Collector, file_path: Path) -> pytest.Collector | None:
    """Collect scenario YAML files under sim/scenarios and sim/incidents."""
    if file_path.suffix == ".yaml" and file_path.parent.name in ("scenarios", "incidents"):
        return ScenarioFile.from_parent(parent, path=file_path)
    return None


def golden_path(scenario: Path) -> Path:
    """Where a scenario's golden output lives."""
    if scenario.parent.name == "incidents":
        return scenario.parent / scenario.stem / "expected.out"
    return scenario.with_suffix(".out")


class ScenarioFile(pytest.File):
    """One scenario file: a single golden item."""

    def collect(self) -> list[pytest.Item]:
        """One item per file."""
        return [GoldenItem.from_parent(self, name="golden")]


class GoldenItem(pytest.Item):
    """Runs the scenario's policies with its seed and diffs the table with the golden file."""

    def runtest(self) -> None:
        """Run and compare."""
        sc = load_scenario(self.path)
        report, _ = run_scenario(sc)
        got = render_table(report)
        for name, pol in report["policies"].items():
            law = pol["littles_law"]
            assert law["rel_error"] < 1e-6, f"{name}: Little's law off: {law}"
            total = sum(sum(c[s] for s in ("completed", "rejected", "timed_out", "truncated",
                                           "cancelled", "failed", "unfinished"))
                        for c in pol["classes"].values())
            assert total == report["requests"], f"{name}: {total} end states"
        golden = golden_path(self.path)
        if _UPDATE or not golden.exists():
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(got, encoding="utf-8")
            if not _UPDATE:
                pytest.fail(f"{golden} was missing and has been written; review and commit it")
            return
        want = golden.read_text(encoding="utf-8")
        if got != want:
            diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True),
                                                str(golden), "this run"))
            raise GoldenMismatch(diff)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        """Show the diff for a golden mismatch."""
        if isinstance(excinfo.value, GoldenMismatch):
            return f"golden output differs (LLMFLOW_UPDATE_GOLDENS=1 to accept):\n{excinfo.value}"
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Path, int, str]:
        """Where the item comes from."""
        return self.path, 0, f"golden: {self.path.name}"


class GoldenMismatch(AssertionError):
    """The table differs from the golden file."""
