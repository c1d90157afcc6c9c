"""`llmflow trace replay`: exit 0 when every action matches, 1 at a mismatch, 2 for no trace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from llmflow._core import Runtime
from llmflow.cli import main
from llmflow.config import load_settings

if TYPE_CHECKING:
    import pytest


def _trace() -> str:
    settings = load_settings(data={
        "backends": [{"name": "b", "kv_blocks": 10_000}],
        "tenants": [{"name": "app", "tier": "normal"}],
        "gate": {"max_concurrency_per_gpu": 1}})
    rt = Runtime(settings.to_runtime(), trace=True)
    for i in range(1, 4):
        rt.arrive(i, "app", 100, 50, True, i)
    rt.tokens(1, 50, 1_000)
    rt.done(1, 2_000)
    return rt.take_trace()


def test_a_faithful_trace_replays(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "t.jsonl").write_text(_trace())
    assert main(["trace", "replay", str(tmp_path / "t.jsonl")]) == 0
    assert capsys.readouterr().out == "replayed 5 events, 6 actions: every action matches\n"


def test_a_doctored_trace_names_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    lines = _trace().splitlines()
    first = json.loads(lines[1])
    first["act"][0]["start"]["priority"] += 1
    lines[1] = json.dumps(first)
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["trace", "replay", str(tmp_path / "t.jsonl")]) == 1
    assert "line 2" in capsys.readouterr().err


def test_no_trace_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "t.jsonl").write_text('{"hello": 1}\n')
    assert main(["trace", "replay", str(tmp_path / "t.jsonl")]) == 2
    assert main(["trace", "replay", str(tmp_path / "missing.jsonl")]) == 2
    assert capsys.readouterr().err.count("error:") == 2


DATA = Path(__file__).parent / "data"  # committed traces


def test_a_trace_from_before_client_signals_still_replays(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`data/trace_before_signals.jsonl` was recorded by the runtime before arrivals carried
    `retries` and `deadline_ms` (queueing, a refusal, a queue timeout, a first-token cut)."""
    old = DATA / "trace_before_signals.jsonl"
    assert '"retries"' not in old.read_text()
    assert main(["trace", "replay", str(old)]) == 0
    assert capsys.readouterr().out == "replayed 11 events, 14 actions: every action matches\n"


def test_a_trace_carrying_client_signals_replays(tmp_path: Path) -> None:
    """A client's retry count and deadline go into its arrival's line, and the replay decides
    with them: the request whose deadline the queue cannot meet is refused again; a doctored
    deadline (long enough to queue) is found."""
    settings = load_settings(data={
        "backends": [{"name": "b", "kv_blocks": 10_000}],
        "tenants": [{"name": "app", "tier": "normal"}],
        "gate": {"max_concurrency_per_gpu": 1}})
    rt = Runtime(settings.to_runtime(), trace=True)
    rt.arrive(1, "app", 100, 50, True, 0)
    refused = rt.arrive(2, "app", 100, 50, True, 1, retries=1, deadline_ms=2_000)
    assert [(a.status, a.reason) for a in refused] == [(429, "client_deadline")]
    rt.arrive(3, "app", 100, 50, True, 2, retries=0, deadline_ms=60_000)
    text = rt.take_trace()
    arrivals = [json.loads(line)["ev"]["arrive"] for line in text.splitlines()[1:]]
    said = [(a.get("retries"), a.get("deadline_ms")) for a in arrivals]
    assert said == [(None, None), (1, 2_000), (0, 60_000)]
    (tmp_path / "t.jsonl").write_text(text)
    assert main(["trace", "replay", str(tmp_path / "t.jsonl")]) == 0
    (tmp_path / "d.jsonl").write_text(text.replace('"deadline_ms":2000', '"deadline_ms":20000'))
    assert main(["trace", "replay", str(tmp_path / "d.jsonl")]) == 1
