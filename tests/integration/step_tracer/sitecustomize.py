"""A step log from inside a real vLLM engine (`LLMFLOW_STEP_TRACE=path.jsonl`): diagnostics only.

Put this folder on the vLLM process's PYTHONPATH. Python imports `sitecustomize` in every
process, the engine core's included; when `vllm.v1.engine.core` is first imported, its
`EngineCore.step` is wrapped to write one JSON line per step: when it began, was planned and
ended (`time.monotonic()`), the engine thread's seconds on a CPU and waiting for one in it,
each scheduled request's tokens and its context before the step (with its prompt and output
lengths, to tell a decode from a prefill or a recompute), and the requests preempted while
planning it; and
`add_request`, to write one line per request the engine takes in (`arrive`). In the model
worker's process (the CPU build runs it apart, pinned), `Worker.execute_model` and
`sample_tokens` write a line each (`worker`): the compute inside a step, and the worker's own
wait for a CPU.
`tests/integration/step_costs.py` reads it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
import time

_PATH = os.environ.get("LLMFLOW_STEP_TRACE")


def _sched_ns() -> tuple[int, int]:
    """This thread's nanoseconds on a CPU and runnable but waiting for one (Linux)."""
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat", "rb") as f:
        run, wait = f.read().split()[:2]
    return int(run), int(wait)


def _out():
    # Open for the process's life: line-buffered, so a killed server loses no whole step.
    return open(_PATH, "a", buffering=1, encoding="utf-8")


def _install_worker(worker_module: object) -> None:
    """Wrap the model worker's `execute_model` and `sample_tokens` (its process's compute)."""
    out = _out()
    worker = worker_module.Worker  # type: ignore[attr-defined]
    for name in ("execute_model", "sample_tokens"):
        plain = getattr(worker, name)

        def timed(self, *args, _plain=plain, _name=name, **kwargs):
            wait = _sched_ns()[1]
            start, cpu = time.monotonic(), time.thread_time()
            try:
                return _plain(self, *args, **kwargs)
            finally:
                out.write(json.dumps({
                    "worker": _name, "start": start, "end": time.monotonic(),
                    "cpu": time.thread_time() - cpu, "waited": (_sched_ns()[1] - wait) / 1e9,
                }) + "\n")

        setattr(worker, name, timed)


def _install(core_module: object) -> None:
    """Wrap the engine core's `step` and `add_request` (vLLM 0.32's V1 `EngineCore`)."""
    out = _out()
    engine = core_module.EngineCore  # type: ignore[attr-defined]
    plain = engine.step

    def step(self):
        wait = _sched_ns()[1]
        start, cpu = time.monotonic(), time.thread_time()
        sched = self.scheduler
        original = sched.schedule
        seen = {}

        def schedule(*args, **kwargs):
            so = original(*args, **kwargs)
            seen["out"] = so
            seen["planned"] = time.monotonic()
            # After planning, a request's computed count already holds this step's tokens.
            seen["reqs"] = [
                [rid, n, r.num_computed_tokens - n, r.num_prompt_tokens, r.num_output_tokens]
                for rid, n in so.num_scheduled_tokens.items()
                for r in (sched.requests[rid],)
            ]
            return so

        sched.schedule = schedule
        try:
            result = plain(self)
        finally:
            del sched.schedule
        so = seen.get("out")
        if so is None or not so.total_num_scheduled_tokens:
            return result
        out.write(json.dumps({
            "start": start, "planned": seen["planned"], "end": time.monotonic(),
            "cpu": time.thread_time() - cpu,
            "waited": (_sched_ns()[1] - wait) / 1e9,
            "reqs": seen["reqs"], "preempted": sorted(so.preempted_req_ids or ()),
            "new": [nr.req_id for nr in so.scheduled_new_reqs],
        }) + "\n")
        return result

    engine.step = step
    plain_add = engine.add_request

    def add_request(self, request, *args, **kwargs):
        out.write(json.dumps({"arrive": time.monotonic(), "rid": request.request_id,
                              "prompt": request.num_prompt_tokens}) + "\n")
        return plain_add(self, request, *args, **kwargs)

    engine.add_request = add_request


_HOOKS = {"vllm.v1.engine.core": _install, "vllm.v1.worker.gpu_worker": _install_worker}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        install = _HOOKS.get(fullname)
        if install is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        plain_exec = loader.exec_module

        def exec_module(module):
            plain_exec(module)
            install(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if _PATH:
    sys.meta_path.insert(0, _Finder())
