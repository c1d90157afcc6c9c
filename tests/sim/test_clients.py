"""Client behaviour: backoff, timeouts and re-sends, stalled readers, user-perceived latency."""

from __future__ import annotations

import random
from typing import Any

import pytest

from llmflow.sim.clients import backoff_delay
from llmflow.sim.runner import run_scenario
from llmflow.sim.scenario import Retry, Scenario


def _scenario(client: dict[str, Any], output: int = 400) -> Scenario:
    return Scenario.model_validate({
        "title": "t", "seed": 1, "duration_s": 60,
        "cluster": [{"name": "h100", "gpu": "h100", "model": "llama-3-8b"}],
        "workload": [{"name": "c", "tenant": "app", "arrival": {"kind": "poisson",
                      "rate_per_s": 1.0}, "prompt_tokens": {"kind": "fixed", "value": 500},
                      "output_tokens": {"kind": "fixed", "value": output}, "client": client}],
        "policies": {"direct": {"kind": "direct"}, "llmflow": {}}})


def test_backoff_doubles_to_the_cap_and_honours_retry_after() -> None:
    rng = random.Random(1)
    p = Retry(base_s=1.0, cap_s=8.0, jitter="none")
    assert [backoff_delay(p, k, 0.0, rng) for k in range(5)] == [1.0, 2.0, 4.0, 8.0, 8.0]
    assert backoff_delay(p, 0, 5.0, rng) == 5.0
    equal = Retry(base_s=4.0, cap_s=60.0, jitter="equal")
    assert all(2.0 <= backoff_delay(equal, 0, 0.0, rng) <= 4.0 for _ in range(100))


def test_a_stalled_reader_loses_its_slot_behind_a_gateway_only() -> None:
    # readers freeze after 20 tokens of a ~45 s answer; the gateway cancels them 30 s
    # (stall_timeout) after their window fills, vLLM alone generates all 7,000 tokens for nobody
    report, _ = run_scenario(_scenario({"stall_after_tokens": 20}, output=7000))
    direct = report["policies"]["direct"]["classes"]["c"]
    gated = report["policies"]["llmflow"]["classes"]["c"]
    assert direct["cancelled"] == gated["cancelled"] == direct["arrived"]
    assert report["policies"]["direct"]["generated_tokens"] == 7000 * direct["arrived"]
    assert report["policies"]["llmflow"]["generated_tokens"] < 6000 * gated["arrived"]


def test_latency_counts_from_the_first_attempt() -> None:
    # a 5 ms first-token timeout can never be met: every attempt times out and is re-sent
    # twice, so each request takes three attempts and ends timed out
    report, _ = run_scenario(_scenario({"timeout_s": 0.005, "retries_on_timeout": 2}),
                             ["direct"])
    c = report["policies"]["direct"]["classes"]["c"]
    assert c["timed_out"] == c["arrived"]
    assert c["attempts_mean"] == pytest.approx(3.0)
    assert c["ttft_s"]["p50"] is None


def test_disconnect_after_tokens_cancels() -> None:
    report, _ = run_scenario(_scenario({"disconnect_after_tokens": 50}), ["direct"])
    c = report["policies"]["direct"]["classes"]["c"]
    assert c["cancelled"] == c["arrived"]
    assert report["policies"]["direct"]["generated_tokens"] == 50 * c["arrived"]
