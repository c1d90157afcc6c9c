"""The rows' rules on made-up evidence: each can pass, fail or be n/a, for the stated reason."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from llmflow.conformance import invariants
from llmflow.conformance.backend import Backend, Record
from llmflow.conformance.client import Outcome
from llmflow.conformance.phases import BUFFER_BOUND, Evidence, Limits
from llmflow.conformance.report import Row, failed, render, write_json

if TYPE_CHECKING:
    from pathlib import Path

LIMITS = Limits(abort_within_s=1.0, stall_within_s=5.0, flood_size=4, fresh_requests=1,
                settle_s=1.0)


def _answer(tag: str, status: int, **fields: object) -> Outcome:
    out = Outcome(tag, stream=True, planned=4, sent_at=0.0, status=status, answered_at=0.01)
    for name, value in fields.items():
        setattr(out, name, value)
    return out


def test_a_reply_is_complete_only_with_every_token_and_one_done() -> None:
    assert _answer("a", 200, tokens=4, done_events=1).verdict() == "complete"
    assert _answer("a", 200, tokens=3, done_events=1).verdict().startswith("broken: 3 of 4")
    assert _answer("a", 200, tokens=4, done_events=2).verdict() == "broken: 2 [DONE] events"
    assert _answer("a", 200, tokens=2, done_events=1, error_events=1).verdict() == "error"
    assert _answer("a", 200, tokens=4, done_events=1, after_end=True).verdict().startswith(
        "broken: data after")
    assert _answer("a", 429).verdict() == "error"
    assert Outcome("a", True, 4, 0.0, failure="ReadError").verdict() == "broken: ReadError"


def test_every_429_needs_a_positive_whole_retry_after() -> None:
    ev = Evidence()
    assert invariants.retry_after(ev).status == "n/a"
    ev.read = [_answer("a", 429, headers={"retry-after": "2"})]
    assert invariants.retry_after(ev).status == "pass"
    for bad in ({}, {"retry-after": "0"}, {"retry-after": "1.5"}, {"retry-after": "soon"}):
        ev.read = [_answer("a", 429, headers={"retry-after": "2"}), _answer("b", 429, headers=bad)]
        row = invariants.retry_after(ev)
        assert row.status == "fail", bad
        assert row.measured.startswith("1 of 2 429s without"), row


def test_the_cap_is_judged_only_when_claimed() -> None:
    backend = Backend(peak_running=5)
    ev = Evidence(peaks={"flood": 5})
    claims = invariants.Claims(max_concurrency=None, tiers=False, refusal_within_s=2.0)
    assert invariants.cap(claims, LIMITS, ev, backend).status == "n/a"
    for cap, status in ((4, "fail"), (5, "pass")):
        claims = invariants.Claims(max_concurrency=cap, tiers=False, refusal_within_s=2.0)
        assert invariants.cap(claims, LIMITS, ev, backend).status == status


def test_a_flood_without_refusals_or_with_slow_ones_fails_the_bounded_queue() -> None:
    claims = invariants.Claims(max_concurrency=1, tiers=False, refusal_within_s=2.0)
    backend = Backend()
    ev = Evidence(flood=[_answer(str(i), 200) for i in range(4)])
    row = invariants.bounded_queue(claims, LIMITS, ev, backend)
    assert (row.status, row.measured[:12]) == ("fail", "0 of 4 refus")
    ev.flood[3] = _answer("3", 408, answered_at=0.2)
    assert invariants.bounded_queue(claims, LIMITS, ev, backend).status == "pass"
    ev.flood[3] = _answer("3", 503, answered_at=30.0)
    assert invariants.bounded_queue(claims, LIMITS, ev, backend).status == "fail"


def test_a_disconnect_must_reach_the_backend_as_an_abort_in_time() -> None:
    def left(outcome: str, ended_at: float | None) -> Evidence:
        record = Record("x", received_at=0.0, ended_at=ended_at, outcome=outcome)
        return Evidence(left=[(_answer("x", 200), 1.0, record)] * 3)

    assert invariants.disconnect(LIMITS, left("aborted", 1.2)).status == "pass"
    assert invariants.disconnect(LIMITS, left("aborted", 2.5)).status == "fail"  # 1.5 s late
    assert invariants.disconnect(LIMITS, left("completed", 1.1)).status == "fail"
    assert invariants.disconnect(LIMITS, left("running", None)).status == "fail"


def test_a_stalled_client_is_judged_by_its_backend_request() -> None:
    ev = Evidence()
    assert invariants.stall_slot(LIMITS, ev).status == "fail"  # never reached the backend
    assert invariants.stall_memory(ev).status == "n/a"
    ev.stalled = Record("stall", 0.0, ended_at=1.0, outcome="aborted", bytes_sent=4 << 20)
    assert invariants.stall_slot(LIMITS, ev).status == "pass"
    assert invariants.stall_memory(ev).status == "pass"
    ev.stalled = Record("stall", 0.0, ended_at=None, bytes_sent=BUFFER_BOUND + 1)
    assert invariants.stall_slot(LIMITS, ev).status == "fail"
    assert invariants.stall_memory(ev).status == "fail"


def test_vip_is_na_without_keys_and_fails_if_refused_or_unloaded() -> None:
    no_tiers = invariants.Claims(max_concurrency=2, tiers=False, refusal_within_s=2.0)
    tiers = invariants.Claims(max_concurrency=2, tiers=True, refusal_within_s=2.0)
    served = [_answer(f"v{i}", 200, tokens=4, done_events=1, ended_at=0.5) for i in range(3)]
    flood = Evidence(vip=served, batch=[_answer("b", 429)], vip_running=[2, 2, 2])
    assert invariants.vip(no_tiers, LIMITS, flood).status == "n/a"
    assert invariants.vip(tiers, LIMITS, flood).status == "pass"
    refused = Evidence(vip=[*served[:2], _answer("v2", 429)], batch=[_answer("b", 429)])
    assert invariants.vip(tiers, LIMITS, refused).status == "fail"
    idle = Evidence(vip=served, batch=[_answer("b", 200)], vip_running=[0, 0, 0])
    assert "did not fill the gateway" in invariants.vip(tiers, LIMITS, idle).measured


def test_the_table_and_json_carry_every_row(tmp_path: Path) -> None:
    rows = [Row("a rule", "did a thing", "pass", "3 of 3"), Row("b", "x", "fail", "y" * 120)]
    text = render(rows, "title")
    assert text.splitlines()[0] == "title"
    assert "| FAIL   |" in text
    assert text.endswith("1 passed, 1 failed, 0 n/a")
    assert failed(rows)
    write_json(rows, "http://gw", tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["passed"] is False
    assert [r["status"] for r in data["rows"]] == ["pass", "fail"]
