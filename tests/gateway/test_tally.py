"""The per-request metrics and the access log, counted once in the core for both paths.

The same traffic sent through the native front and through Python (the app served alone)
must come out as the same `/metrics` families and the same access-log rows (ids and times
masked), each checked against what the test sent and saw on the wire: the statuses, the
request ids, the tokens the fake vLLM sent. The rows are the bytes `csv.writer` writes of
`request_log.format_row`'s cells, a tenant named with a comma and quotes included. The
families keep the names, help, types and bucket bounds prometheus_client gave them. What
both paths counted is also held to its golden, the Python path's recorded (`goldens`), which
is the reference alone once the Python path is gone.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import re
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import pytest

from llmflow.request_log import COLUMNS, format_row

from .both_paths import by_front, on_each_path, paths, read_stream
from .goldens import plain, with_reference
from .harness import Harness, start_gateway, until
from .test_front_native import CHAT, COMPLETIONS, _body

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.anyio

ACME, CROWD = 'acme, "inc"', "crowd"  # the first needs quoting in a CSV cell
KEYS = {ACME: "k-acme-0001", CROWD: "k-crowd-001"}
TENANTS = [
    {"name": ACME, "tier": "vip", "api_keys": [KEYS[ACME]]},
    {"name": CROWD, "tier": "normal", "api_keys": [KEYS[CROWD]]},
]
TIERS = ("vip", "normal")
FAMILIES = (
    "llmflow_requests",
    "llmflow_ttft_seconds",
    "llmflow_e2e_seconds",
    "llmflow_queue_wait_seconds",
    "llmflow_tokens_streamed",
    "llmflow_truncations",
    "llmflow_upstream_aborts",
)
_TIMES = ("arrival_s", "admitted_s", "first_token_s", "end_s")


async def _send(h: Harness, tenant: str, path: str, **extra: Any) -> dict[str, Any]:
    """One request as `tenant`; what the test saw of it."""
    body = _body(path, **extra)
    auth = {"authorization": f"Bearer {KEYS[tenant]}"}
    async with h.client.stream("POST", path, json=body, headers=auth) as r:
        status, text, headers = r.status_code, (await r.aread()).decode(), dict(r.headers)
    code = json.loads(text)["error"]["code"] if status != 200 else None
    return {"tenant": tenant, "status": status, "id": headers["x-request-id"],
            "native": by_front(headers), "code": code}


async def _traffic(h: Harness) -> list[dict[str, Any]]:
    """A held stream, one queued behind it, two refused (of either tier), then served ones of
    either kind."""
    fake = h.fakes["b0"]
    sent = []
    held = asyncio.create_task(_send(h, ACME, CHAT, fake={"step": True}))
    await until(lambda: fake.running == 1)
    queued = asyncio.create_task(_send(h, ACME, COMPLETIONS, max_tokens=3))
    await until(lambda: h.gateway.runtime.queued == 1)
    sent.append(await _send(h, ACME, CHAT))  # the one waiting place is taken: 429
    sent.append(await _send(h, CROWD, CHAT))  # 429 too
    fake.release(10)
    sent += [await held, await queued]
    sent.append(await _send(h, ACME, CHAT, stream=False, max_tokens=4))
    sent.append(await _send(h, ACME, COMPLETIONS, stream=False, max_tokens=2))
    sent.append(await _send(h, CROWD, CHAT, max_tokens=6))
    await until(lambda: h.gateway.runtime.live == 0 and h.gateway._native_live() == 0)
    return sent


def _rows(log: Path) -> tuple[list[str], list[dict[str, str]]]:
    """The file's lines (without their `\\r\\n`) and its rows, each line checked to be what
    `csv.writer` writes of `format_row`'s cells of the values it holds."""
    raw = log.read_bytes().decode()
    assert raw.endswith("\r\n")
    lines = raw.split("\r\n")[:-1]
    assert lines[0] == ",".join(COLUMNS)
    rows = list(csv.DictReader(lines))
    for line, row in zip(lines[1:], rows, strict=True):
        values = [
            (float(v) if v else None) if k in _TIMES else v for k, v in row.items()
        ]
        buf = io.StringIO()
        csv.writer(buf).writerow(format_row(values))
        assert buf.getvalue() == line + "\r\n"
    return lines, rows


def _masked(rows: list[dict[str, str]]) -> list[tuple[str, ...]]:
    """Rows less what differs by path or by run: the ids, the times (present or not kept)."""
    out = []
    for row in rows:
        cells = {**row, "request": "ID"}
        for k in _TIMES:
            cells[k] = "T" if row[k] else ""
        out.append(tuple(cells[k] for k in COLUMNS))
    return sorted(out)


def _families(metrics: str) -> dict[str, float]:
    """The per-request samples, less what timing decides: each histogram's sum, its creation
    time and its buckets below +Inf (their counts are kept)."""
    out = {}
    for line in metrics.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if line.startswith("#") or not name.startswith(FAMILIES) or name.endswith("_created"):
            continue
        if name.endswith("_sum") or (name.endswith("_bucket") and 'le="+Inf"' not in line):
            continue
        key, value = line.rsplit(" ", 1)
        out[key] = float(value)
    return out


def _sample(families: dict[str, float], name: str, **labels: str) -> float:
    for key, value in families.items():
        if key.split("{")[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            return value
    return 0.0


async def test_both_paths_count_and_log_the_same_traffic_as_it_went_over_the_wire(
    tmp_path: Path,
) -> None:
    counted = [plain(await _counted(tmp_path / f"{n}.csv", native=n)) for n in paths()]
    native, python = with_reference(counted)
    assert native == python


async def _counted(
    log: Path, native: bool
) -> tuple[list[tuple[str, ...]], dict[str, float]]:
    """The traffic through one path, checked against what was sent and seen; its rows and its
    per-request families, masked (`_masked`, `_families`)."""
    async with start_gateway(
        server={"access_log": str(log)}, native=native,
        tenants=TENANTS,
        gate={"max_concurrency_per_gpu": 1, "queue": {"max_waiting": 1}},
    ) as h:
        sent = await _traffic(h)
        metrics = (await h.client.get("/metrics")).text
        outcomes = h.gateway.metrics.outcomes
        tokens = h.fakes["b0"].tokens_sent
    assert all(s["native"] == native for s in sent)
    lines, rows = _rows(log)
    assert ',"acme, ""inc""",' in lines[1] or any(',"acme, ""inc""",' in x for x in lines)
    assert len(rows) == len(sent)
    by_id = {r["request"]: r for r in rows}
    assert set(by_id) == {s["id"] for s in sent}  # the ids the clients were answered with
    for s in sent:
        row = by_id[s["id"]]
        assert row["tenant"] == s["tenant"]
        assert row["class"] == {ACME: "vip", CROWD: "normal"}[s["tenant"]]
        if s["status"] == 429:
            assert (row["outcome"], row["reason"], row["admitted_s"]) == (
                "rejected", s["code"], "")
        else:
            assert s["status"] == 200
            assert (row["outcome"], row["reason"], row["backend"]) == ("completed", "", "b0")
            assert row["arrival_s"] <= row["admitted_s"] <= row["first_token_s"] <= row["end_s"]
    assert sum(int(r["output_tokens"]) for r in rows) == tokens  # what the fake vLLM sent
    families = _families(metrics)
    for tier, tenant in (("vip", ACME), ("normal", CROWD)):
        served = sum(s["status"] == 200 for s in sent if s["tenant"] == tenant)
        assert _sample(families, "llmflow_requests_total", tier=tier, outcome="completed") == served
        for code in {s["code"] for s in sent if s["status"] == 429}:
            refused = sum(s["code"] == code for s in sent if s["tenant"] == tenant)
            assert _sample(
                families, "llmflow_requests_total", tier=tier, outcome="rejected", reason=code
            ) == refused
        for histogram in ("ttft", "queue_wait", "e2e"):
            count = _sample(families, f"llmflow_{histogram}_seconds_count", tier=tier)
            assert count == served, histogram
    streamed = [_sample(families, "llmflow_tokens_streamed_total", tier=t) for t in TIERS]
    assert sum(streamed) == tokens
    assert outcomes == Counter(
        ("completed", "completed") if s["status"] == 200 else ("rejected", s["code"]) for s in sent
    )
    assert sorted(s["status"] for s in sent) == [200] * 5 + [429] * 2
    return _masked(rows), families


@on_each_path()
async def test_a_refusal_flood_is_counted_and_logged_exactly(tmp_path: Path, native: bool) -> None:
    flood = 300
    log = tmp_path / "access.csv"
    async with start_gateway(
        server={"access_log": str(log)}, native=native,
        gate={"max_concurrency_per_gpu": 1, "queue": {"max_waiting": 0}},
        # the held stream keeps its slot however long the flood takes on a busy machine (the
        # first-token timeout would cut it, and the flood's last requests would get the slot)
        streaming={"first_token_timeout_ms": None},
    ) as h:
        fake = h.fakes["b0"]
        held = asyncio.create_task(read_stream(h.client, CHAT, _body(fake={"step": True})))
        await until(lambda: fake.running == 1)
        answers = await asyncio.gather(
            *(read_stream(h.client, CHAT, _body()) for _ in range(flood))
        )
        fake.release(10)
        status, _, held_headers = await held
        assert status == 200
        await until(lambda: h.gateway.runtime.live == 0 and h.gateway._native_live() == 0)
        metrics = (await h.client.get("/metrics")).text
    assert [a[0] for a in answers] == [429] * flood
    assert all(by_front(a[2]) == native for a in answers)
    _, rows = _rows(log)
    refused = {r["request"] for r in rows if r["outcome"] == "rejected"}
    assert {r["reason"] for r in rows if r["outcome"] == "rejected"} == {"queue_full"}
    assert refused == {a[2]["x-request-id"] for a in answers}
    assert len(rows) == flood + 1
    assert [r["request"] for r in rows if r["outcome"] == "completed"] == [
        held_headers["x-request-id"]]
    counted = re.findall(r'llmflow_requests_total\{([^}]*)\} (\S+)', metrics)
    assert sorted((labels, float(n)) for labels, n in counted) == [
        ('outcome="completed",reason="completed",tier="normal"', 1.0),
        ('outcome="rejected",reason="queue_full",tier="normal"', float(flood)),
    ]


# What prometheus_client's `Counter`s and `Histogram`s exported before the families moved into
# the core's tally (its `generate_latest`, 0.26): the names, help, types and bucket bounds.
_EXPOSED = """\
# HELP llmflow_requests_total Requests by tier, outcome and reason
# TYPE llmflow_requests_total counter
# HELP llmflow_ttft_seconds Arrival to first token, as the gateway sees it
# TYPE llmflow_ttft_seconds histogram
# HELP llmflow_e2e_seconds Arrival to the last token of a completed request
# TYPE llmflow_e2e_seconds histogram
# HELP llmflow_queue_wait_seconds Time spent queued before admission
# TYPE llmflow_queue_wait_seconds histogram
# HELP llmflow_tokens_streamed_total Generated tokens relayed to clients
# TYPE llmflow_tokens_streamed_total counter
# HELP llmflow_truncations_total Replies cut with a notice
# TYPE llmflow_truncations_total counter
# HELP llmflow_upstream_aborts_total Upstream requests aborted before they finished
# TYPE llmflow_upstream_aborts_total counter"""
_TTFT_LE = "0.005 0.01 0.025 0.05 0.1 0.25 0.5 1.0 1.5 2.5 5.0 10.0 30.0 60.0 +Inf"
_E2E_LE = "0.1 0.25 0.5 1.0 2.5 5.0 10.0 20.0 30.0 60.0 120.0 300.0 600.0 +Inf"


async def test_the_families_are_exported_as_prometheus_client_exported_them(
    tmp_path: Path,
) -> None:
    async with start_gateway(server={"access_log": str(tmp_path / "a.csv")}) as h:
        before = time.time()
        status, _, _ = await read_stream(h.client, CHAT, _body(max_tokens=3))
        assert status == 200
        await until(lambda: h.gateway.runtime.live == 0 and h.gateway._native_live() == 0)
        metrics = (await h.client.get("/metrics")).text
    ours = [x for x in metrics.splitlines() if x.startswith("#") and x.split()[2].startswith(
        FAMILIES) and "_created" not in x]
    assert "\n".join(ours) == _EXPOSED
    for name, bounds in (("ttft", _TTFT_LE), ("e2e", _E2E_LE), ("queue_wait", _TTFT_LE)):
        les = re.findall(rf'llmflow_{name}_seconds_bucket{{le="([^"]+)",tier="normal"}}', metrics)
        assert " ".join(les) == bounds
        created = re.search(rf'llmflow_{name}_seconds_created{{tier="normal"}} (\S+)', metrics)
        assert created is not None
        assert before - 1 <= float(created.group(1)) <= time.time()  # Unix time of its count
    created = re.search(r"llmflow_requests_created\{([^}]*)\} (\S+)", metrics)
    assert created is not None
    assert created.group(1) == 'outcome="completed",reason="completed",tier="normal"'
