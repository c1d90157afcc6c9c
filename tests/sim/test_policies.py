"""Gated policies as hosts of the core runtime: what clients see is what the trace says."""

from __future__ import annotations

import io
import itertools
import json
from typing import Any

import simpy

from llmflow._core import replay_trace
from llmflow.sim.clients import BUSY, COMPLETED, ERROR, REJECTED, Attempt, RequestSpec
from llmflow.sim.cluster import Cluster
from llmflow.sim.metrics import Recorder
from llmflow.sim.policies import GatedPolicy, policy_settings
from llmflow.sim.runner import arrivals
from llmflow.sim.scenario import Scenario
from llmflow.sim.workload import build_requests


def _class(name: str, rate: float, output: int, client: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "tenant": name, "arrival": {"kind": "poisson", "rate_per_s": rate},
            "prompt_tokens": {"kind": "fixed", "value": 500},
            "output_tokens": {"kind": "fixed", "value": output}, "client": client}


# Four slots and six waiting places for ~4 requests/s of 2-3 s answers: 429s and queue timeouts
# with retries, clients that leave after 2 s, 6 s deadlines that truncate long answers, and
# readers that freeze after 10 tokens.
LIFECYCLE = Scenario.model_validate({
    "title": "lifecycle", "seed": 4, "duration_s": 20,
    "cluster": [{"name": "h100", "gpu": "h100", "model": "llama-3-8b"}],
    "workload": [
        _class("chat", 3.0, 300, {"retry_429": {"base_s": 0.1, "cap_s": 1.0, "jitter": "full"}}),
        _class("long", 0.3, 3000, {}),
        _class("leaver", 0.5, 600, {"disconnect_after_s": 2.0}),
        _class("stalled", 0.3, 2000, {"stall_after_tokens": 10}),
    ],
    "policies": {"llmflow": {"config": {
        "gate": {"max_concurrency_per_gpu": 4, "queue": {"max_waiting": 6, "max_wait_ms": 3000}},
        "timeouts": {"total_ms": 6000}, "sla": {"ttft_ms": None},
        "backpressure": {"stall_timeout_ms": 1000, "client_window": 4}}}},
})


class Wire:
    """The clients' side of the gateway: every attempt with when it was sent and when it ended."""

    def __init__(self, env: simpy.Environment, gw: GatedPolicy):
        self.env, self.gw = env, gw
        self.sent: list[tuple[float, Attempt]] = []
        self.ended: dict[int, float] = {}  # by request id

    def send(self, att: Attempt) -> None:
        """Pass the attempt on and note its times."""
        self.sent.append((self.env.now, att))
        self.gw.send(att)
        att.done.callbacks.append(lambda _ev: self._ended(att))

    def _ended(self, att: Attempt) -> None:
        self.ended[att.key] = self.env.now

    def cancel(self, att: Attempt) -> None:
        """Pass the disconnect on."""
        self.gw.cancel(att)


def _simulate(sc: Scenario) -> tuple[Wire, str]:
    env = simpy.Environment()
    spec = sc.policies["llmflow"]
    cluster = Cluster(env, sc.cluster, "priority", spec.engine)
    trace = io.StringIO()
    gw = GatedPolicy(env, cluster, policy_settings("llmflow", spec, sc, cluster), trace)
    wire = Wire(env, gw)
    env.process(arrivals(env, build_requests(sc, sc.seed), sc, wire, Recorder(env), sc.seed))
    env.run(until=sc.horizon_s)
    gw.flush_trace()
    return wire, trace.getvalue()


def _actions(trace: str, kind: str) -> dict[int, dict[str, Any]]:
    """The trace's actions of one kind, by request id."""
    found = {}
    for line in trace.splitlines()[1:]:
        for action in json.loads(line).get("act", []):
            if kind in action:
                found[action[kind]["id"]] = action[kind]
    return found


def test_a_simulated_trace_replays_to_the_same_actions() -> None:
    _, trace = _simulate(LIFECYCLE)
    events, actions = replay_trace(trace)
    assert events == len(trace.splitlines()) - 1
    assert actions > 300


def test_what_clients_see_is_what_the_trace_says() -> None:
    wire, trace = _simulate(LIFECYCLE)
    replies, cuts = _actions(trace, "reply"), _actions(trace, "cut")
    honoured = 0
    by_request: dict[int, list[tuple[float, Attempt]]] = {}
    for sent in wire.sent:
        by_request.setdefault(id(sent[1].req), []).append(sent)
    for attempts in by_request.values():
        for (_, att), (resent, _) in itertools.pairwise(attempts):
            if att.outcome in (REJECTED, BUSY):
                # the client waited at least the header's whole seconds, as sent on the wire
                assert att.retry_after == replies[att.key]["retry_after_s"] >= 1
                assert resent - wire.ended[att.key] >= att.retry_after - 1e-9
                honoured += 1
    stalled = {att.key for _, att in wire.sent if att.reason == "stalled"}
    assert stalled == {i for i, cut in cuts.items() if cut["reason"] == "client_stall"}
    outcomes = {(att.outcome, att.reason) for _, att in wire.sent}
    assert {("busy", "queue_timeout"), ("truncated", "deadline"), ("cancelled", "disconnect"),
            (COMPLETED, "")} <= outcomes
    assert honoured > 20
    assert len(stalled) > 3


def test_a_request_the_engine_refuses_frees_its_slot_for_the_next(env: simpy.Environment) -> None:
    # one slot; B (too long for the model) and C queue behind A: when A ends, B is refused by
    # vLLM (400) and C starts in that same instant, not at the next scrape
    sc = Scenario.model_validate({
        "title": "t", "duration_s": 1,
        "cluster": [{"name": "h100", "gpu": "h100", "model": "llama-3-8b",
                     "engine": {"max_model_len": 2048}}],
        "workload": [_class("app", 1.0, 10, {})],
        "policies": {"gate": {"preset": "seed-gate",
                              "config": {"gate": {"max_concurrency_per_gpu": 1}}}}})
    cluster = Cluster(env, sc.cluster, "fcfs", {})
    gw = GatedPolicy(env, cluster, policy_settings("gate", sc.policies["gate"], sc, cluster))
    a, b, c = (Attempt(env, RequestSpec(0, "app", prompt, 50, 50), None)
               for prompt in (100, 3000, 100))
    for att in (a, b, c):
        gw.send(att)
    env.run(until=5)
    assert (a.outcome, b.outcome, c.outcome) == (COMPLETED, ERROR, COMPLETED)
    assert a.seq is not None
    assert c.seq is not None
    assert c.seq.arrival == a.seq.t_end
    assert gw.runtime.live == 0



# Clients that say what an SDK says: a 2 s timeout, retries on 429s, against two slots.
SIGNALLING = Scenario.model_validate({
    "title": "signals", "seed": 5, "duration_s": 10,
    "cluster": [{"name": "h100", "gpu": "h100", "model": "llama-3-8b"}],
    "workload": [_class("chat", 6.0, 400, {
        "timeout_s": 2.0, "retry_429": {"base_s": 0.2, "cap_s": 1.0, "jitter": "full"}})],
    "policies": {"llmflow": {"config": {
        "gate": {"max_concurrency_per_gpu": 2, "queue": {"max_waiting": 6, "max_wait_ms": 3000}},
        "sla": {"ttft_ms": None}}}},
})


def test_each_attempt_tells_the_runtime_its_retries_and_timeout() -> None:
    """Every arrival in the trace carries its attempt's retries so far (0, 1, 2, ... for each
    user request, in the order its attempts were sent) and its client's 2 s timeout; the
    runtime refused some at once for that deadline, and the trace replays."""
    wire, trace = _simulate(SIGNALLING)
    said = {}
    for line in trace.splitlines()[1:]:
        event = json.loads(line)["ev"]  # a name ("timer") or {name: fields}
        if isinstance(event, dict) and "arrive" in event:
            arrive = event["arrive"]
            said[arrive["id"]] = (arrive.get("retries"), arrive.get("deadline_ms"))
    tries: dict[int, list[int]] = {}
    for _, att in wire.sent:
        assert said[att.key] == (att.retries, 2000)
        tries.setdefault(id(att.req), []).append(att.retries)
    assert all(seen == list(range(len(seen))) for seen in tries.values())
    assert max(len(seen) for seen in tries.values()) > 1  # some were retried
    assert any(r["reason"] == "client_deadline" for r in _actions(trace, "reply").values())
    replay_trace(trace)
