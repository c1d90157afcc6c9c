"""Fairness: two continuously backlogged tenants of equal weight get equal service, within the
Virtual Token Counter bound.

Covers: the VTC bound with our cost model. Dispatch always picks the smaller counter, so a
tenant can only pull ahead through requests it already has in flight: at most `cap` of them,
each costing at most `U` weighted tokens. Hence |service_a - service_b| <= cap * U.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmflow import Admitted, Governor
from property_tests.strategies import policy_config

W_IN, W_OUT, KV_WEIGHT, KV_COST_TOKENS = 1.0, 2.0, 1.0, 1024.0
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
    config = policy_config(max_waiting=10_000, per_gpu=per_gpu, gpus=(1,))
    config["tenants"] = [
        {"name": "a", "tier": "normal", "weight": 1.0},
        {"name": "b", "tier": "normal", "weight": 1.0},
    ]
    config.update(
        kv_pressure_threshold=None,
        queue_timeout_ms=None,
        first_token_timeout_ms=None,
        request_timeout_ms=None,
    )
    core = Governor(config)
    bound = per_gpu * max_request_cost()
    left: dict[int, int] = {}
    owner: dict[int, str] = {}
    queued = {"a": 0, "b": 0}
    running: list[int] = []
    next_id, now = 0, 0

    def backlog(tenant: str) -> None:
        nonlocal next_id
        prompt, output = sizes[next_id % len(sizes)]
        next_id += 1
        decision = core.submit(next_id, tenant, prompt, output, now)
        left[next_id], owner[next_id] = output, tenant
        if isinstance(decision, Admitted):
            running.append(next_id)
        else:
            queued[tenant] += 1

    # Both tenants arrive together and are never allowed to run dry: each keeps more queued
    # requests than one dispatch can take (the cap).
    for _ in range(per_gpu + 1):
        backlog("a")
        backlog("b")
    for pick, n in picks:
        now += 1000
        for admission in core.dispatch(now):
            running.append(admission.request_id)
            queued[owner[admission.request_id]] -= 1
        rid = running[pick % len(running)]
        n = min(n, left[rid])
        core.on_tokens(rid, n, now)
        left[rid] -= n
        if left[rid] == 0:
            core.finish(rid, "completed", now)
            running.remove(rid)
        for tenant in ("a", "b"):
            for _ in range(per_gpu + 1 - queued[tenant]):
                backlog(tenant)
        gap = abs(core.tenant_service("a") - core.tenant_service("b"))
        assert gap <= bound, f"service gap {gap:.0f} beyond the VTC bound {bound:.0f}"
