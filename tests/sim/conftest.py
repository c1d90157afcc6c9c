"""Fixtures of the simulator tests: a SimPy `env`, a `log` of (event, time) pairs, and helpers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import simpy

if TYPE_CHECKING:
    from llmflow.sim.engine import Seq


@pytest.fixture
def env() -> simpy.Environment:
    """A fresh simulation environment."""
    return simpy.Environment()


class Log(list[tuple[str, float]]):
    """Records engine callbacks as `(f"{event} {rid}", time)`; usable as a `Seq` owner."""

    def __init__(self) -> None:
        super().__init__()
        self.first: dict[int, float] = {}
        self.ended: dict[int, tuple[float, str, int]] = {}

    def on_first_token(self, seq: Seq, now: float) -> None:
        """Engine callback."""
        self.first[seq.rid] = now
        self.append((f"first {seq.rid}", round(now, 9)))

    def on_finished(self, seq: Seq, now: float) -> None:
        """Engine callback."""
        self.ended[seq.rid] = (now, seq.finish_reason, seq.gen)
        self.append((f"end {seq.rid}", round(now, 9)))


@pytest.fixture
def log() -> Log:  # the type is local to this file; tests annotate it as Any
    """An empty callback log."""
    return Log()
