"""The `llmflow` command line: every command has --help; capacity and config check work."""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

from llmflow.cli import build_parser, main

if TYPE_CHECKING:
    from pathlib import Path


def _commands(
    parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()
) -> list[tuple[str, ...]]:
    found = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, (*prefix, name))
    return found


COMMANDS = _commands(build_parser())


def test_every_expected_command_exists() -> None:
    names = {" ".join(c) for c in COMMANDS}
    assert {"capacity", "config check", "sim run", "simserve", "serve",
            "trace replay"} <= names


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "llmflow")
def test_help_on_every_command(
    command: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: llmflow")
    assert len(out.splitlines()) >= 3


def test_capacity_seed_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capacity"]) == 0
    out = capsys.readouterr().out
    assert "left for KV cache         10.0 GB" in out
    assert out.rstrip().splitlines()[-1].split()[1] == "2"


def test_capacity_from_model_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capacity", "--model", "llama-3-70b", "--gpu", "a100-80g", "--tp", "4"]) == 0
    out = capsys.readouterr().out
    # 70.6B params x 2 bytes / 4 GPUs; 320 KiB per token / 4 GPUs; 79.14 GiB per A100 80GB.
    assert "weights per GPU           35.3 GB" in out
    assert "KV per token              80.0 KiB per GPU" in out
    assert "slots                      130" in out


def test_capacity_unknown_preset(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capacity", "--gpu", "tpu-v9"]) == 2
    assert "choose one of" in capsys.readouterr().err


def test_config_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("gate:\n  max_concurrency_per_gpu: 8\n")
    assert main(["config", "check", str(good)]) == 0
    assert "ok" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("gate:\n  max_concurrency_per_gpu: -1\n")
    assert main(["config", "check", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "gate.max_concurrency_per_gpu" in err
    assert "-1" in err


def test_config_check_names_a_split_pool_missing_a_role(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "split.yaml"
    bad.write_text(
        "backends:\n"
        "  - {name: p0, url: 'http://p0:8000', models: [m], role: prefill}\n"
        "  - {name: p1, url: 'http://p1:8000', models: [m], role: prefill}\n"
    )
    assert main(["config", "check", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "backends[0].role" in err
    assert 'no "decode" backend' in err


def test_console_script_runs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "llmflow.cli", "capacity", "--avg-context", "2048"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.rstrip().splitlines()[-1].split()[:2] == ["slots", "4"]
