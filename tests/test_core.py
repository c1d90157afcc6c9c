"""The PyO3 bindings of the policy core: values, errors and the request lifecycle."""

from __future__ import annotations

import copy
from typing import Any

import pytest

import llmflow
from llmflow import (
    Admitted,
    ConfigError,
    Decision,
    DuplicateRequestError,
    Governor,
    InvalidArgumentError,
    PolicyError,
    Queued,
    Rejected,
    UnknownBackendError,
    UnknownTenantError,
)


def test_lifecycle_returns_everything(core_config: dict[str, Any]) -> None:
    g = Governor(core_config)
    first = g.submit(1, "shop", 100, 50, 0)
    assert first == Admitted(1, "sim0", first.priority)
    g.on_first_token(1, 200_000)
    g.on_tokens(1, 40, 300_000)
    assert g.request_kv(1, 300_000)[0] == 9  # ceil(140 / 16)
    assert g.kv_blocks_in_use == 9
    assert g.finish(1, "completed", 1_000_000) is True
    assert g.finish(1, "completed", 1_000_000) is False
    assert (g.running, g.queued, g.live, g.kv_blocks_in_use) == (0, 0, 0, 0)
    assert g.snapshot(1_000_000)["counters"]["finished"]["completed"] == 1


def test_queue_dispatch_and_reject(core_config: dict[str, Any]) -> None:
    g = Governor(core_config)
    decisions = [g.submit(i, "shop", 10, 10, 0) for i in range(1, 8)]
    kinds = [type(d) for d in decisions]
    # 2 slots, then normal may fill 80% of a 4-deep queue (3), then it is shed.
    assert kinds == [Admitted] * 2 + [Queued] * 3 + [Rejected] * 2
    assert [d.position for d in decisions if isinstance(d, Queued)] == [0, 1, 2]
    last = decisions[-1]
    assert isinstance(last, Rejected)
    assert last.reason == "tier_shed"
    assert last.retry_after_s > 0
    assert g.finish(1, "cancelled", 10)
    (admission,) = g.dispatch(10)
    assert (admission.request_id, admission.backend) == (3, "sim0")
    assert admission.queue_wait_s == pytest.approx(10e-6)


def test_vip_uses_the_rest_of_the_queue(core_config: dict[str, Any]) -> None:
    g = Governor(core_config)
    for i in range(5):
        g.submit(i, "shop", 10, 10, 0)
    assert _reason(g.submit(10, "shop", 10, 10, 0)) == "tier_shed"
    assert isinstance(g.submit(11, "acme", 10, 10, 0), Queued)
    # The queue is full now; VIP pushes out the newest normal request instead of waiting
    # behind it, and that request's client gets a 429 with its own Retry-After.
    pushed = g.submit(12, "acme", 10, 10, 0)
    match pushed:
        case Queued(request_id=12, position=1, displaced=4, displaced_retry_after_s=retry):
            assert retry is not None
            assert retry > 0
        case _:
            pytest.fail(f"expected a displacement: {pushed!r}")
    assert not g.is_live(4)
    assert g.snapshot(0)["counters"]["rejected"]["displaced"] == 1
    g.submit(13, "acme", 10, 10, 0)
    g.submit(14, "acme", 10, 10, 0)
    assert _reason(g.submit(15, "acme", 10, 10, 0)) == "queue_full"


def _reason(decision: Decision) -> str | None:
    return decision.reason if isinstance(decision, Rejected) else None


def test_expire_reports_reason(core_config: dict[str, Any]) -> None:
    g = Governor(core_config)
    g.submit(1, "shop", 10, 10, 0)
    # the seed's 3000 ms first-token timeout, on top of the 10-token prompt's own prefill at the
    # configured 8000 tokens/s (1,250 us)
    assert g.next_deadline_us() == 3_001_250
    assert g.expire(3_001_249) == []
    (expired,) = g.expire(3_001_250)
    assert (expired.request_id, expired.reason, expired.was_running) == (
        1, "first_token_timeout", True,
    )
    assert expired.backend == "sim0"
    assert g.live == 0


def test_observe_and_breaker(core_config: dict[str, Any]) -> None:
    g = Governor(core_config)
    g.observe_backend("sim0", 0, kv_usage=0.2, running=0, waiting=0, preemptions_total=0)
    g.observe_backend("sim0", 1, kv_usage=0.97, preemptions_total=3, kv_blocks=1000)
    assert g.shed_level == 1
    assert _reason(g.submit(1, "shop", 10, 10, 2)) == "kv_pressure"
    assert isinstance(g.submit(2, "acme", 10, 10, 2), Admitted)
    snap = g.snapshot(2)
    assert snap["backends"][0]["kv_capacity_blocks"] == 1000
    assert snap["backends"][0]["preemptions"] == 3


def test_stale_metrics_halve_the_slots(core_config: dict[str, Any]) -> None:
    # 4 slots; the last scrape at t=0 goes stale after the default 3 s: the backend gets half
    # its slots until a fresh scrape, which lets the queued requests in.
    g = Governor({**core_config, "max_concurrency_per_gpu": 4})
    assert core_config["stale_after_ms"] == 3000
    g.observe_backend("sim0", 0, kv_usage=0.0, running=0, waiting=0)
    late = 3_000_001
    assert g.snapshot(late)["backends"][0]["stale"] is True
    kinds = [type(g.submit(i, "acme", 10, 10, late)).__name__ for i in range(1, 5)]
    assert kinds == ["Admitted", "Admitted", "Queued", "Queued"]
    assert g.dispatch(late) == []
    g.observe_backend("sim0", late, kv_usage=0.0, running=2, waiting=0)
    assert sorted(a.request_id for a in g.dispatch(late)) == [3, 4]
    assert (g.running, g.queued) == (4, 0)


def test_fresh_metrics_give_the_full_cap(core_config: dict[str, Any]) -> None:
    # The control: the same crowd just inside the staleness window gets all 4 slots.
    g = Governor({**core_config, "max_concurrency_per_gpu": 4})
    g.observe_backend("sim0", 0, kv_usage=0.0, running=0, waiting=0)
    kinds = [type(g.submit(i, "acme", 10, 10, 3_000_000)).__name__ for i in range(1, 5)]
    assert kinds == ["Admitted"] * 4


def test_draining_and_health(core_config: dict[str, Any]) -> None:
    g = Governor(core_config)
    g.set_backend_health("sim0", False)
    assert _reason(g.submit(1, "acme", 1, 1, 0)) == "no_healthy_backend"
    g.set_backend_health("sim0", True)
    g.start_draining()
    assert g.draining
    assert _reason(g.submit(2, "acme", 1, 1, 0)) == "draining"


def test_copy_is_independent(core_config: dict[str, Any]) -> None:
    g = Governor(core_config)
    g.submit(1, "shop", 10, 10, 0)
    probe = copy.copy(g)
    probe.finish(1, "completed", 1)
    assert (g.live, probe.live) == (1, 0)


def test_decisions_match_by_class() -> None:
    decisions: list[Decision] = [
        Admitted(1, "sim0", 1000),
        Queued(2, 0, 0.5, 1000, displaced=7, displaced_retry_after_s=0.25),
        Rejected(3, "queue_full", 1.5),
    ]
    seen = []
    for d in decisions:
        match d:
            case Admitted(rid, backend):
                seen.append(("admitted", rid, backend))
            case Queued(rid, position, _, _, displaced):
                seen.append(("queued", rid, position, displaced))
            case Rejected(rid, reason, retry):
                seen.append(("rejected", rid, reason, retry))
    assert seen == [
        ("admitted", 1, "sim0"),
        ("queued", 2, 0, 7),
        ("rejected", 3, "queue_full", 1.5),
    ]
    assert repr(decisions[0]) == "Admitted(request_id=1, backend='sim0', priority=1000)"
    assert repr(decisions[2]) == "Rejected(request_id=3, reason='queue_full', retry_after_s=1.5)"
    assert "displaced=7" in repr(decisions[1])
    with pytest.raises(InvalidArgumentError, match="reject reason"):
        Rejected(4, "bored", 1.0)  # type: ignore[arg-type]


def test_snapshot_is_plain_python(core_config: dict[str, Any]) -> None:
    g = Governor(core_config)
    g.submit(1, "shop", 10, 10, 0)
    snap = g.snapshot(0)
    assert list(snap["queued_by_tier"]) == ["vip", "normal", "batch"]
    assert snap["counters"]["admitted"] == 1
    assert list(snap["counters"]["finished"]) == ["completed", "error", "timeout", "cancelled"]
    (request,) = snap["requests"]
    assert (request["id"], request["state"], request["backend"]) == (1, "prefill", "sim0")
    assert isinstance(snap["drain_rate_per_s"], float)
    assert snap["backends"][0]["reported_running"] is None


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda g: g.submit(1, "nobody", 1, 1, 0), UnknownTenantError, "tenants"),
        (lambda g: g.submit(1, "shop", -1, 1, 0), InvalidArgumentError, "prompt_tokens"),
        (lambda g: g.on_tokens(1, -5, 0), InvalidArgumentError, "n must be >= 0"),
        (lambda g: g.finish(1, "done", 0), InvalidArgumentError, "completed, error"),
        (lambda g: g.observe_backend("gpu9", 0), UnknownBackendError, "backends"),
        (lambda g: g.observe_backend("sim0", 0, kv_usage=1.5), InvalidArgumentError, "0..1"),
    ],
)
def test_bad_arguments_raise_clear_errors(
    core_config: dict[str, Any], call: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        call(Governor(core_config))


def test_duplicate_live_id(core_config: dict[str, Any]) -> None:
    g = Governor(core_config)
    g.submit(7, "shop", 1, 1, 0)
    with pytest.raises(DuplicateRequestError, match="7"):
        g.submit(7, "shop", 1, 1, 0)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: c.update(max_concurrency_per_gpu=0), "max_concurrency_per_gpu"),
        (lambda c: c.update(kv_pressure_threshold=1.2), "kv_pressure_threshold"),
        (lambda c: c.update(surprise=1), "unknown field `surprise`"),
        (lambda c: c["tenants"][0].update(tier="gold"), "tenants[0].tier"),
        (lambda c: c.update(backends=[]), "backends"),
        (lambda c: c.update(strategy="lottery"), "lottery"),
    ],
)
def test_bad_core_config(core_config: dict[str, Any], mutate: Any, message: str) -> None:
    mutate(core_config)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Governor(core_config)


def test_config_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError, match="mapping"):
        Governor([1, 2])  # type: ignore[arg-type]


def test_errors_share_a_base() -> None:
    for error in (ConfigError, UnknownTenantError, DuplicateRequestError, InvalidArgumentError):
        assert issubclass(error, PolicyError)


def test_capacity_functions() -> None:
    assert int(llmflow.kv_slots(80e9, 64e9, 6e9, 4096, 1e6)) == 2
    assert llmflow.kv_bytes_per_token(80, 8, 128, 2, tp=4) == 80 * 1024
    with pytest.raises(InvalidArgumentError):
        llmflow.kv_bytes_per_token(0, 8, 128, 2)
