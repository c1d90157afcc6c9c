"""Fairness: two continuously backlogged tenants of equal weight get equal service, within the
Virtual Token Counter bound.

Covers: the VTC bound with our cost model, on service the test counts itself from the tokens it
fed in (never the core's own counter). A request costs `input_token_weight` per prompt token
when it starts, and each chunk of `n` output tokens costs `n * (output_token_weight + kv_weight
* context / 1024)`, the context counted after the chunk. Dispatch always picks the smaller
counter, so a tenant can only pull ahead through requests it already has in flight: at most
`cap` of them, each costing at most `U` weighted tokens. Hence |service_a - service_b| <= cap * U.
Also: the core's `tenant_service` equals this count (within float rounding).
"""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from llmflow import Admitted, Governor
from property_tests.strategies import policy_config

# Weights away from the core's defaults (1, 2, 1), so a count that ignored them would show.
W_IN, W_OUT, KV_WEIGHT = 0.5, 3.0, 2.0  # per prompt token; per output token; per 1024 context
KV_COST_TOKENS = 1024.0  # context tokens per extra unit of output cost (times KV_WEIGHT)
MAX_PROMPT, MAX_OUTPUT = 400, 200


def max_request_cost() -> float:
    context = MAX_PROMPT + MAX_OUTPUT
    return W_IN * MAX_PROMPT + MAX_OUTPUT * (W_OUT + KV_WEIGHT * context / KV_COST_TOKENS)


requests = st.tuples(st.integers(1, MAX_PROMPT), st.integers(1, MAX_OUTPUT))


@given(
    per_gpu=st.integers(1, 4),
    sizes=st.lists(requests, min_size=4, max_size=40),
    picks=st.lists(st.tuples(st.integers(0, 1000), st.integers(1, 64)), min_size=50, max_size=300),
)
def test_backlogged_tenants_stay_within_vtc_bound(
    per_gpu: int, sizes: list[tuple[int, int]], picks: list[tuple[int, int]]
) -> None:
    config = policy_config(
        max_waiting=10_000,
        per_gpu=per_gpu,
        gpus=(1,),
        tenants=[
            {"name": "a", "tier": "normal", "weight": 1.0},
            {"name": "b", "tier": "normal", "weight": 1.0},
        ],
        kv_pressure_threshold=None,
        queue_timeout_ms=None,
        first_token_timeout_ms=None,
        request_timeout_ms=None,
        input_token_weight=W_IN,
        output_token_weight=W_OUT,
        kv_weight=KV_WEIGHT,
    )
    core = Governor(config)
    bound = per_gpu * max_request_cost()
    prompt: dict[int, int] = {}
    left: dict[int, int] = {}
    fed: dict[int, int] = {}
    owner: dict[int, str] = {}
    served = {"a": 0.0, "b": 0.0}  # weighted tokens, counted from what this test fed in
    queued = {"a": 0, "b": 0}
    running: list[int] = []
    next_id, now = 0, 0

    def started(rid: int) -> None:
        running.append(rid)
        served[owner[rid]] += W_IN * prompt[rid]

    def dispatch() -> None:
        for admission in core.dispatch(now):
            started(admission.request_id)
            queued[owner[admission.request_id]] -= 1

    def backlog(tenant: str) -> None:
        nonlocal next_id
        next_id += 1
        prompt[next_id], left[next_id] = sizes[next_id % len(sizes)]
        owner[next_id], fed[next_id] = tenant, 0
        if isinstance(core.submit(next_id, tenant, prompt[next_id], left[next_id], now), Admitted):
            started(next_id)
        else:
            queued[tenant] += 1
        dispatch()  # the admissions submit made for queued requests come out here

    def feed(rid: int, n: int) -> None:
        core.on_tokens(rid, n, now)
        left[rid] -= n
        fed[rid] += n
        context = prompt[rid] + fed[rid]
        served[owner[rid]] += n * (W_OUT + KV_WEIGHT * context / KV_COST_TOKENS)

    # Both tenants arrive together and are never allowed to run dry: each keeps more queued
    # requests than one dispatch can take (the cap).
    for tenant in ("a", "b") * (per_gpu + 1):
        backlog(tenant)
    for pick, n in picks:
        now += 1000
        dispatch()
        rid = running[pick % len(running)]
        feed(rid, min(n, left[rid]))
        if left[rid] == 0:
            core.finish(rid, "completed", now)
            running.remove(rid)
        for tenant in ("a", "b"):
            while queued[tenant] < per_gpu + 1:
                backlog(tenant)
        gap = abs(served["a"] - served["b"])
        assert gap <= bound, f"service gap {gap:.0f} beyond the VTC bound {bound:.0f}"
        for tenant, ours in served.items():
            theirs = core.tenant_service(tenant)
            assert math.isclose(theirs, ours, rel_tol=1e-9), (tenant, theirs, ours)
