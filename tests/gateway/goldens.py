"""Goldens: the Python path's replies, recorded, the reference that outlives it.

The parity tests hold the native front's replies to the Python path's (`both_paths`): the
same request on each, compared as a client reads it, masked of what differs by path or by run.
Each masked reply of the Python path is also kept here, one file per test case,
`goldens/<module>/<test>[<params>].golden`, and every reply is checked against it:
`reference(native, python)` fails the test unless the Python path's reply is its golden (so
each golden is checked against the real Python path while it lives) and the native front's
is too, and returns the reference the test then holds the native reply to, as it always did.
The masks are the tests' own, applied before `reference`; what still differs by run although
both paths agree on it within one (a Retry-After the time taken shortens, a fingerprint keyed
per process) is masked for the golden only (`mask`), the two paths still compared whole.

Recording: only when asked, with `LLMFLOW_RECORD_GOLDENS=1` in the environment; the tests
run then write the Python path's masked replies (`make parity-goldens` runs every file that
has goldens; review the diff under `goldens/` before committing it). Without it a golden is
never written: a missing one fails its test, with the command that records it. A test whose
requests are drawn at random keeps in its golden those it drew once (`inputs`), with the
replies to them.

Dropping the Python path: set `both_paths.PYTHON_PATH = False`. The runs on both paths then
run the native front alone, the tests pass `reference` no Python reply, and it returns the
golden read back in the native reply's type: each test holds the native reply to the golden
only. Recording needs the Python path; once it is gone, the goldens are what is left of it.

A golden file holds one part per comparison in its test, in order: a line
`### <part> (<n> bytes)`, then the n bytes compared (text as UTF-8, any other value as JSON,
its objects' keys sorted, a container of containers one item a line), then a newline. The
bytes are exact (`goldens/.gitattributes`: no line-ending conversion), so each `\\r\\n`
stays as it went on the wire.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = [
    "GOLDENS",
    "RECORD",
    "all_held",
    "case",
    "inputs",
    "plain",
    "reference",
    "with_reference",
]

GOLDENS = Path(__file__).parent / "goldens"
RECORD = os.environ.get("LLMFLOW_RECORD_GOLDENS") == "1"  # write the Python path's replies
_HEAD = re.compile(rb"### (.+) \((\d+) bytes\)\n")
_UNSAFE = re.compile(r"[^A-Za-z0-9._=,+\-\[\]]")  # out of a file's name: `/`, spaces...
T = TypeVar("T")


@dataclass
class _Case:
    """The goldens of the running test: read from its file when first asked for."""

    path: Path
    stored: dict[str, bytes] | None = None  # None: not read yet
    recorded: dict[str, bytes] | None = None  # this run's recording, once it has begun
    asked: dict[str, int] = field(default_factory=dict)  # times each part was asked for
    held: set[str] = field(default_factory=set)  # the parts read, by their numbered names

    def name(self, part: str) -> str:
        """`part`, numbered from its second comparison in the test on."""
        self.asked[part] = self.asked.get(part, 0) + 1
        return part if self.asked[part] == 1 else f"{part} {self.asked[part]}"

    def golden(self, name: str) -> bytes:
        if self.stored is None:
            self.stored = _read(self.path) if self.path.exists() else {}
        if name not in self.stored:
            where = self.path.relative_to(GOLDENS.parent.parent.parent)
            pytest.fail(
                f"no golden for part {name!r} in {where}: record it from the Python path with "
                f"LLMFLOW_RECORD_GOLDENS=1 (run this test with it, or `make parity-goldens`; "
                f"review the diff, commit it)",
                pytrace=False,
            )
        self.held.add(name)
        return self.stored[name]

    def record(self, name: str, data: bytes) -> None:
        """Keep `data` as part `name`; the test's first recording starts its file anew."""
        if self.recorded is None:
            self.recorded = {}
        self.recorded[name] = data
        self.held.add(name)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_bytes(
            b"".join(
                b"### %s (%d bytes)\n%s\n" % (part.encode(), len(body), body)
                for part, body in self.recorded.items()
            )
        )
        self.stored = dict(self.recorded)


_case: _Case | None = None


@contextlib.contextmanager
def case(module: str, test: str) -> Iterator[None]:
    """The goldens `reference` reads while in it: those of `test` (its name with its
    parameters) in the module named `module`."""
    global _case
    _case = _Case(GOLDENS / module / (_UNSAFE.sub("_", test) + ".golden"))
    try:
        yield
    finally:
        _case = None


def all_held() -> None:
    """Fail the running test (once it passed) if its golden has a part it never held a reply
    to: a comparison the test no longer makes, or one its file was recorded by that it now
    skips."""
    if _case is None or _case.stored is None:
        return
    left = [name for name in _case.stored if name not in _case.held]
    if left:
        pytest.fail(f"{_case.path}: parts never compared: {left} (record it again?)", pytrace=False)


def reference(
    native: T, python: T | None, part: str = "reply", mask: Callable[[T], T] | None = None
) -> T:
    """The reference for a masked reply of the native front: the Python path's (`python`),
    once it is checked to be the golden of this `part` of the running test, or (`None`: the
    Python path is gone) the golden itself; `native` is checked to be the golden too.

    Args:
        native: The native front's reply, masked: bytes, text, or a JSON value that JSON
            reads back as itself (lists, not tuples).
        python: The Python path's reply to the same request, masked as `native` is; `None`
            once the Python path is gone (`both_paths.PYTHON_PATH`).
        part: Which of the test's comparisons this is (a name repeated is numbered).
        mask: What differs by run although both paths agree on it in one (a value that
            depends on the time the test took): applied to either reply, not changing it,
            before it is held to the golden.

    Returns:
        `python` if given, else the golden in `native`'s type (as `mask` leaves it).
    """
    masked = mask or _same
    if _case is None:
        raise RuntimeError("reference() outside a test (the gateway conftest opens its case)")
    name = _case.name(part)
    if python is not None:
        theirs = _encode(masked(python))
        if RECORD:
            _case.record(name, theirs)
        _differ(theirs, _case.golden(name), f"the Python path's reply ({name})")
    elif RECORD:
        pytest.fail("recording needs the Python path (both_paths.PYTHON_PATH)", pytrace=False)
    golden = _case.golden(name)
    _differ(_encode(masked(native)), golden, f"the native front's reply ({name})")
    return python if python is not None else _decode(golden, native)


def with_reference(
    replies: list[T], part: str = "reply", mask: Callable[[T], T] | None = None
) -> tuple[T, T]:
    """The native reply of `replies` (one per path, native first, masked: as `both_paths`
    runs them) and its reference (`reference`), to hold the one to the other; once the
    Python path is gone, with `mask`, the native reply as `mask` leaves it and the golden."""
    native, *python = replies
    assert len(python) <= 1, replies
    held = reference(native, python[0] if python else None, part, mask)
    return (native if python or mask is None else mask(native)), held


def inputs(draw: Callable[[], list[bytes]]) -> list[bytes]:
    """The running test's inputs, kept in its golden (parts `input <n>`) beside the replies
    to them: read back, or drawn by `draw` when recording a golden that has none (a golden
    recorded again keeps its inputs: delete its file to draw anew); none kept and not
    recording, the test fails, as for a missing golden. For a test whose requests are drawn
    at random (a property test's strategies): those drawn once are kept with the Python
    path's replies to them."""
    if _case is None:
        raise RuntimeError("inputs() outside a test (the gateway conftest opens its case)")
    kept = _read(_case.path) if _case.path.exists() else {}
    found = [data for name, data in kept.items() if name.startswith("input ")]
    if not RECORD:
        _case.golden("input 0")  # fails if none are kept
        _case.held.update(f"input {n}" for n in range(len(found)))
        return found
    found = found or draw()
    for n, data in enumerate(found):
        _case.record(f"input {n}", data)
    return found


def plain(value: Any) -> Any:
    """`value` as JSON reads it back (lists for tuples, a dict for a `Counter`): a value
    `reference` can keep, and equal to its golden read back."""
    return json.loads(json.dumps(value))


def _same(value: T) -> T:
    return value


def _encode(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    text = _json(value, "\n")
    assert json.loads(text) == value, f"not read back as itself from JSON: {value!r}"
    return text.encode()


def _json(value: Any, line: str) -> str:
    """`value` as JSON, a container of containers one item a line, any other on one line; an
    object's keys sorted (Python compares dicts in any order: the order is no part of it)."""
    items = sorted(value.items()) if isinstance(value, dict) else value
    if not isinstance(value, (dict, list, tuple)) or not any(
        isinstance(v, (dict, list, tuple)) for v in (value.values() if isinstance(value, dict)
                                                      else value)
    ):
        return json.dumps(value, ensure_ascii=False, sort_keys=True)
    inner = line + " "
    if isinstance(value, dict):
        shown = [f"{json.dumps(k, ensure_ascii=False)}: {_json(v, inner)}" for k, v in items]
        ends = "{}"
    else:
        shown, ends = [_json(v, inner) for v in items], "[]"
    return ends[0] + inner + ("," + inner).join(shown) + line + ends[1]


def _decode(data: bytes, like: Any) -> Any:
    if isinstance(like, bytes):
        return data
    return data.decode() if isinstance(like, str) else json.loads(data)


def _differ(data: bytes, golden: bytes, what: str) -> None:
    if data == golden:
        return
    lines = difflib.unified_diff(
        golden.decode(errors="backslashreplace").splitlines(),
        data.decode(errors="backslashreplace").splitlines(),
        "golden",
        "this run",
        lineterm="",
    )
    shown = "\n".join(line if len(line) < 400 else line[:400] + "..." for line in lines)
    pairs = enumerate(zip(data, golden, strict=False))  # where they part, or the shorter ends
    at = next((i for i, (x, y) in pairs if x != y), min(len(data), len(golden)))
    start = max(at - 40, 0)
    first = f"golden {golden[start : at + 40]!r}, this run {data[start : at + 40]!r}"
    pytest.fail(
        f"{what} is not its golden ({_case.path if _case else ''}), first at byte {at}: "
        f"{first}\n{shown}",
        pytrace=False,
    )


def _read(path: Path) -> dict[str, bytes]:
    data, parts = path.read_bytes(), {}
    at = 0
    while at < len(data):
        head = _HEAD.match(data, at)
        assert head is not None, f"{path}: no part's heading at byte {at}"
        start = head.end()
        end = start + int(head.group(2))
        assert data[end : end + 1] == b"\n", f"{path}: part {head.group(1)!r} overruns"
        parts[head.group(1).decode()] = data[start:end]
        at = end + 1
    return parts
