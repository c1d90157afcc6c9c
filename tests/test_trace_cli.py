"""`llmflow trace replay`: exit 0 when every action matches, 1 at a mismatch, 2 for no trace."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from llmflow._core import Runtime
from llmflow.cli import main
from llmflow.config import load_settings

if TYPE_CHECKING:
    from pathlib import Path

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
