"""CPU placement and contention of the vLLM processes, from `/proc` (Linux only).

vLLM's CPU build pins its model-executing worker to some cores (on a 2-core machine: core 0,
keeping core 1 for the API server). Timing tests keep their own load (the test client, the
gateway) off those cores with `spare_cpus`, and measure how long vLLM's threads waited for a
CPU with `SchedClock`: `/proc/<pid>/task/<tid>/schedstat` gives each thread's time on a CPU and
time runnable but waiting, so `wait / run` is the slowdown other processes imposed on vLLM.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["Sched", "SchedClock", "pinned", "process_tree", "spare_cpus"]

_PROC = Path("/proc")


def process_tree(root: int) -> list[int]:
    """`root` and all its descendants."""
    children: dict[int, list[int]] = {}
    for stat in _PROC.glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def spare_cpus(root: int) -> set[int]:
    """CPUs none of `root`'s pinned processes is bound to (empty if none is pinned, or if the
    pinned ones cover every CPU)."""
    every = os.sched_getaffinity(0) | set(range(os.cpu_count() or 1))
    bound: set[int] = set()
    for pid in process_tree(root):
        with contextlib.suppress(OSError):
            cpus = os.sched_getaffinity(pid)
            if cpus != every:
                bound |= cpus
    spare = every - bound
    return spare if bound and spare else set()


@contextlib.contextmanager
def pinned(cpus: set[int]) -> Iterator[None]:
    """Run this process (and children started meanwhile) on `cpus`; no-op when empty."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@dataclass(frozen=True)
class Sched:
    """Seconds vLLM's threads ran and waited for a CPU over some interval."""

    run_s: float
    wait_s: float

    @property
    def wait_share(self) -> float:
        """Waiting time per running time (0: never delayed by other processes)."""
        return self.wait_s / self.run_s if self.run_s else 0.0


class SchedClock:
    """Reads the summed schedstat of a process tree; `lap()` gives the time since the last."""

    def __init__(self, root: int):
        self.root = root
        self._last = self._read()

    def _read(self) -> tuple[int, int]:
        run = wait = 0
        for pid in process_tree(self.root):
            for stat in _PROC.glob(f"{pid}/task/*/schedstat"):
                with contextlib.suppress(OSError, ValueError):
                    r, w, _ = stat.read_text().split()
                    run, wait = run + int(r), wait + int(w)
        return run, wait

    def lap(self) -> Sched:
        """Run and wait time since the previous lap (or since creation)."""
        now = self._read()
        run, wait = now[0] - self._last[0], now[1] - self._last[1]
        self._last = now
        return Sched(run / 1e9, wait / 1e9)
