"""The seed's incidents replayed: what each policy would have done."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from llmflow.sim.runner import run_scenario
from llmflow.sim.scenario import load_scenario

INCIDENTS = Path(__file__).resolve().parents[2] / "sim" / "incidents"


@pytest.fixture(scope="module")
def flood() -> dict[str, Any]:
    report, _ = run_scenario(load_scenario(INCIDENTS / "marketing-flood.yaml"))
    return report["policies"]


def test_direct_collapses(flood: dict[str, Any]) -> None:
    # vLLM's unbounded queue reaches the thousands, business users wait minutes, and the
    # avalanche of timeouts and re-sends loses most of the work
    d = flood["direct"]
    assert d["peak_queue"] >= 3000
    business, batch = d["classes"]["business"], d["classes"]["batch"]
    assert business["ttft_s"]["p50"] >= 300
    lost = business["timed_out"] + batch["timed_out"]
    assert lost > (business["arrived"] + batch["arrived"]) / 2
    assert batch["completed"] < batch["arrived"] / 2
    assert d["preemptions"] > 0
    assert d["peak_kv_usage"] == 1.0
    # even with disconnects reaching vLLM, the queue is in the thousands and users wait minutes
    abort = flood["direct-abort"]
    assert abort["peak_queue"] >= 1000
    assert abort["classes"]["business"]["ttft_s"]["p99"] >= 60


def test_seed_gate_holds_16_per_gpu_and_200_waiting(flood: dict[str, Any]) -> None:
    for name in ("seed-gate", "seed-gate-fifo"):
        p = flood[name]
        assert p["peak_running"] == 16 * p["gpus"]
        assert p["peak_queue"] <= 200
        assert p["rejections"].get("queue_full", 0) > 0
        # the gate absorbs the flood: no avalanche, at most a few batch calls lost to their
        # own 120 s timeout (they re-send once)
        assert p["classes"]["batch"]["completed"] >= 0.9 * 1500


def test_llmflow_keeps_business_fast_and_loses_no_batch_request(flood: dict[str, Any]) -> None:
    p = flood["llmflow"]
    assert p["classes"]["business"]["ttft_s"]["p99"] <= 1.5
    batch = p["classes"]["batch"]
    assert batch["completed"] == batch["arrived"] == 1500
    assert batch["retries_429"] > 0  # it went through 429 + backoff
    assert p["verdict"]["summary"] == "held"


def test_long_report_is_cut_and_its_blocks_reused() -> None:
    sc = load_scenario(INCIDENTS / "long-report-timeout.yaml")
    report, _ = run_scenario(sc)
    direct, llm = report["policies"]["direct"], report["policies"]["llmflow"]
    # without a deadline the report runs to its end and the short ones wait for it
    assert direct["classes"]["report"]["completed"] == 1
    assert direct["classes"]["short"]["ttft_s"]["p50"] > 100
    # with the 45 s deadline: truncated, ~1,200 characters returned
    rep = llm["classes"]["report"]
    assert rep["truncated"] == 1
    assert 1000 <= rep["truncated_chars_mean"] <= 1400
    # the three short ones (arrived at t = 20 s) start in the step right after the cut at
    # t = 50 s, first tokens ~2.2-2.6 s later, not after the whole report (~150 s)
    short = llm["classes"]["short"]
    assert short["completed"] == 3
    # on the defaults their ~30 s wait meets the queue's 30 s limit at the cut: a short one
    # may come back once after a 503's Retry-After, never more
    assert short["attempts_mean"] <= 2.0
    assert 50 - 20 < short["ttft_s"]["p50"] <= short["ttft_s"]["p99"] < 50 - 20 + 4


def test_llmflow_beats_the_seed_gate_on_every_figure(flood: dict[str, Any]) -> None:
    # Work-conserving sharing: batch borrows what the business headroom leaves, so protecting
    # business no longer costs the batch job time (the fixed half share made it 38% slower)
    ours, gate = flood["llmflow"], flood["seed-gate"]
    assert ours["classes"]["batch"]["last_done_s"] < gate["classes"]["batch"]["last_done_s"]
    assert ours["goodput_rps"] >= gate["goodput_rps"]
    # more running than the seed's 16 per GPU, bounded by KV, never preempting
    assert ours["peak_running"] > 16 * ours["gpus"]
    assert ours["preemptions"] == 0
    assert ours["peak_kv_usage"] < 0.95


# Every scenario that runs llmflow.
SCENARIOS = sorted(
    p for p in [*INCIDENTS.glob("*.yaml"), *(INCIDENTS.parent / "scenarios").glob("*.yaml")]
    if "llmflow" in load_scenario(p).policies
)
# Where another policy still wins, and why (xfail is strict: fixing one fails the test until
# the mark is removed).
KNOWN_LOSSES: dict[str, str] = {
    # llmflow runs 2P:2D there (co-located layouts are other hardware, not rivals). Direct
    # 2P:2D wins goodput, 17.1 against 16.7/s: in the decode-bound chat phase a freed decode
    # slot waits, held, through its next request's prefill hop and transfer (the hard cap),
    # where vLLM's proxy prefills ahead and queues the KV-ready request at the decode
    # instance; chat within its 0.25 s SLO 64.5% against 66.7% (llmflow's RAG and chat TTFT
    # p99 are both better: 0.93 vs 0.96 s, 1.01 vs 1.16 s)
    "pd-split": "a decode slot is held through the next request's prefill hop (the hard cap)",
}
# Where llmflow keeps work waiting with the engines' binding resource free, and why.
KNOWN_IDLE: dict[str, str] = {
    # the occupancy is cluster-wide: the decode pool idles while RAG prompts wait for the
    # prefill pool, and prefill pacing holds prompts the prefill pool had room for
    "pd-split": "cluster-wide occupancy counts the idle decode pool; prefill pacing holds back",
}


@functools.cache
def _report(path: Path) -> dict[str, Any]:
    report, _ = run_scenario(load_scenario(path))
    return report


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_no_policy_beats_llmflow(path: Path, request: pytest.FixtureRequest) -> None:
    if path.stem in KNOWN_LOSSES:
        request.applymarker(pytest.mark.xfail(reason=KNOWN_LOSSES[path.stem], strict=True))
    report = _report(path)
    assert report["dominance"]["beaten"] == [], report["dominance"]["summary"]


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_llmflow_leaves_no_engine_idle_while_work_waits(
    path: Path, request: pytest.FixtureRequest
) -> None:
    if path.stem in KNOWN_IDLE:
        request.applymarker(pytest.mark.xfail(reason=KNOWN_IDLE[path.stem], strict=True))
    # Whenever work waits (in the gateway's queue or vLLM's), the engines are busy on their
    # binding resource (sequences, KV or the step's token budget, from the simulated engine's
    # own gauges), apart from what the policy keeps free on purpose (the latency tiers'
    # headroom, the KV committed to running requests' growth), which the report shows.
    occ = _report(path)["policies"]["llmflow"]["occupancy_while_queued"]
    if occ["busy"] is None:  # nothing waited across two samples (rate-limits, steady)
        assert occ["waiting_share"] == 0.0
        return
    # What is kept has no bound of its own: over-reserving shows up as lost goodput or
    # makespan, which the dominance test above checks.
    assert occ["busy"] + occ["reserved"] >= 0.9, occ


def _scenario(name: str) -> Path:
    return INCIDENTS.parent / "scenarios" / f"{name}.yaml"


def test_goodput_counts_over_the_same_window_for_every_policy() -> None:
    # Over each policy's own run, a policy that drops work would end sooner and look faster.
    sc = load_scenario(_scenario("brownout"))
    for pol in _report(_scenario("brownout"))["policies"].values():
        on_time = sum(c["within_slo"] for c in pol["classes"].values())
        assert pol["goodput_rps"] == pytest.approx(on_time / sc.duration_s, abs=1e-6)


def test_the_operators_variants_and_contracts_are_set_apart() -> None:
    # brownout's llmflow-brownout (answers clamped to 300 tokens) beats the defaults: it is
    # listed, not counted; the crawler's makespan is set by its contract, and direct, which
    # ignores the contract, finishes it ~7x sooner without beating llmflow
    verdict = _report(_scenario("brownout"))["dominance"]
    assert verdict["beaten"] == []
    assert verdict["variants"]
    assert all(v.startswith("llmflow-brownout ") for v in verdict["variants"])
    limits = _report(_scenario("rate-limits"))
    pols = limits["policies"]
    crawler = {name: p["classes"]["crawler"]["last_done_s"] for name, p in pols.items()}
    assert crawler["direct"] * 5 < crawler["llmflow"]
    assert limits["dominance"]["beaten"] == []
    assert "makespan of crawler set by its rate limit" in limits["dominance"]["summary"]


def test_other_hardware_layouts_are_set_apart() -> None:
    # pd-split: llmflow runs 2P:2D; the co-located and 1P:3D layouts are other hardware (the
    # co-located ones win the chat phase with four decode GPUs), listed apart; only direct on
    # the same 2P:2D is a rival. The prefill hop's FCFS priority beats direct 2P:2D's RAG tail.
    report = _report(_scenario("pd-split"))
    verdict = report["dominance"]
    assert verdict["layouts"]
    assert {v.split()[0] for v in verdict["layouts"]} <= {"colocated-4x", "pd-1p3d",
                                                          "llmflow-colocated"}
    assert all(v.startswith("pd-2p2d ") for v in verdict["beaten"]), verdict
    rag = {n: p["classes"]["rag"]["ttft_p99_lost_inf_s"] for n, p in report["policies"].items()}
    assert rag["llmflow"] < rag["pd-2p2d"]


def test_late_lanes_keep_the_fresh_on_time_in_an_overload_the_queue_cannot_hold() -> None:
    # brownout: a 2.6x surge for two minutes, twenty to drain. First come, first served made
    # every newcomer late (205 on time, against vLLM's own 283); serving those still on time
    # first, and each retry in its first arrival's place, keeps most fresh requests on time,
    # loses nothing, and shortens the tail the retries made
    pols = _report(_scenario("brownout"))["policies"]
    on_time = {n: sum(c["within_slo"] for c in p["classes"].values()) for n, p in pols.items()}
    assert on_time["llmflow"] > 1.5 * on_time["direct"]
    chat = pols["llmflow"]["classes"]["chat"]
    assert chat["completed"] + chat["truncated"] == chat["arrived"]
    assert chat["ttft_s"]["p50"] < 5.0  # the steady chat mostly on time through the surge
    assert chat["ttft_p99_lost_inf_s"] < 400.0  # 461 s when the retries reshuffled the queue
