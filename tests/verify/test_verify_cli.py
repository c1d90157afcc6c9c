"""`llmflow config verify FILE`: the runtime's state machine on a user's config, from the CLI.

The sample config passes. An invariant the user declares and the core does not guarantee (at
most one running request per tenant: the core caps backends and tiers, not tenants) breaks, and
the report is the shrunk sequence: two arrivals of that tenant, both started. The same
invariant at the config's total capacity cannot break, and passes.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from llmflow.cli import main

SAMPLE = str(Path(__file__).with_name("sample.yaml"))
TOTAL_SLOTS = 2 * (1 + 2)  # max_concurrency_per_gpu x the backends' GPUs in sample.yaml


def test_the_sample_config_verifies(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "verify", SAMPLE, "--examples", "40", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert re.fullmatch(
        rf"{re.escape(SAMPLE)}: ok — \d+ runs of up to 100 events \(seed 3, "
        r"[\d.]+ s\): no invariant broken\n",
        out,
    ), out
    assert int(re.search(r"(\d+) runs", out).group(1)) >= 40  # type: ignore[union-attr]


def test_an_invariant_the_core_does_not_keep_fails_with_the_shrunk_sequence(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["config", "verify", SAMPLE, "--examples", "200", "--max-running", "shop=1"])
    out = capsys.readouterr().out
    assert code == 1, out
    lines = out.splitlines()
    assert lines[0] == f"{SAMPLE}: BROKEN — your own invariant (--max-running)"
    assert "tenant shop runs 2 requests at once, you expect at most 1" in lines[1]
    steps = [line.strip() for line in lines[3:]]
    arrivals = [s for s in steps if " arrive " in s]
    # Shrunk: the two arrivals that break it, each started at once, and nothing else of note.
    assert len(arrivals) == 2, out
    for line in arrivals:
        assert re.match(r"t=\d+us arrive id=\d+ tenant=shop prompt=\d+ max_tokens=\d+ ", line)
        assert "→ Start(" in line
    assert len(steps) <= len(arrivals) + 2  # the start-up scrapes of the two backends


def test_the_same_invariant_at_the_total_capacity_holds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["config", "verify", SAMPLE, "--examples", "40", "--max-running", f"shop={TOTAL_SLOTS}"]
    assert main(args) == 0, capsys.readouterr().out


def test_a_bad_invariant_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "verify", SAMPLE, "--max-running", "nobody=1"]) == 2
    err = capsys.readouterr().err
    assert "--max-running 'nobody=1'" in err
    assert "acme, nightly, shop" in err


def test_help_names_the_invariants(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["config", "verify", "--help"])
    out = capsys.readouterr().out
    for words in ("--examples", "--seed", "--max-running", "never ends", "cap"):
        assert words in out


@pytest.mark.slow
def test_default_headroom_starts_a_paced_request_once_the_prefill_clears() -> None:
    # config verify's first finding, now fixed in the runtime (it dispatches on a first token):
    # with the default headroom, a request held back by prefill pacing starts once the prefill
    # clears. A process of its own: Hypothesis draws constants from the modules a process has
    # loaded, so a seed replays the same runs only in the same surroundings (as the CLI runs).
    headroom = str(Path(__file__).with_name("headroom.yaml"))
    args = ["config", "verify", headroom, "--examples", "800", "--seed", "7"]
    done = subprocess.run(
        [sys.executable, "-m", "llmflow.cli", *args], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no invariant broken" in done.stdout
