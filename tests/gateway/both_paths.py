"""One request on both paths, the native front's and Python's (the app served alone).

The tests of the routes the front serves natively hold it to the Python path: they send the
same request through each and compare what a client reads. These are the requests on the wire
they share, and the runs on both paths that check each reply was served where it should be.

`PYTHON_PATH` says whether the Python path is still there to run. While it is, each run here
answers on both paths (native first), and the tests hold each masked reply of the Python
path to its golden as well (`goldens.reference`). The deletion of the Python path sets it
False: each run then answers on the native front alone (a list of one), the tests hold the
native reply to the goldens only, and the checks of each path on its own (`on_each_path`)
check the native front's.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import pytest

from .harness import NATIVE_IDS, start_gateway, until

if TYPE_CHECKING:
    import httpx

__all__ = [
    "PYTHON_PATH",
    "by_front",
    "completed",
    "connect",
    "on_each_path",
    "paths",
    "post",
    "raw_on_both_paths",
    "read_stream",
    "refused_on_both_paths",
    "reply_id",
    "streamed_on_both_paths",
    "unsized",
    "without_date",
]


PYTHON_PATH = False  # the app's own serving of the governed routes: deleted


def paths() -> tuple[bool, ...]:
    """The paths a parity test runs a request on, as `native` flags: the native front's, then
    the Python path's while it is there (`PYTHON_PATH`)."""
    return (True, False) if PYTHON_PATH else (True,)


def on_each_path(python: str = "python") -> pytest.MarkDecorator:
    """A test parametrized by `native` over `paths()` (read as the module is collected), its
    cases named `native` and `python` (the Python path's id): a check of each path on its
    own, whose Python case goes with the Python path."""
    return pytest.mark.parametrize("native", paths(), ids=["native", python][: len(paths())])


async def read_stream(
    client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> tuple[int, str, dict[str, str]]:
    """POST `body` and read the whole streamed reply: its status, text and headers."""
    async with client.stream("POST", path, json=body) as r:
        text = (await r.aread()).decode()
        return r.status_code, text, dict(r.headers)


def by_front(headers: dict[str, str]) -> bool:
    """Whether the front served it (its id is from the front's range)."""
    return int(headers["x-request-id"].removeprefix("llmflow-")) >= NATIVE_IDS


async def connect(url: str, payload: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the gateway at `url` with `payload` written on it."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    writer.write(payload)
    await writer.drain()
    return reader, writer


def post(path: str, body: dict[str, Any], close: bool = False) -> bytes:
    """A POST of `body` as JSON, as bytes on the wire (`close`: the connection ends with it)."""
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n"
    )
    if close:
        head += "connection: close\r\n"
    return head.encode() + b"\r\n" + data


def without_date(raw: bytes) -> bytes:
    return re.sub(rb"\r\ndate: [^\r]*", b"", raw)


def completed(metrics: str) -> float:
    """The requests a scrape of `/metrics` counts as completed."""
    found = re.search(r'llmflow_requests_total\{[^}]*outcome="completed"[^}]*\} (\S+)', metrics)
    assert found is not None, metrics
    return float(found.group(1))


def reply_id(raw: bytes) -> int:
    """The number of a raw reply's request id (`x-request-id: llmflow-<n>`)."""
    found = re.search(rb"x-request-id: llmflow-(\d+)", raw)
    assert found is not None, raw
    return int(found.group(1))


def unsized(raw: bytes) -> bytes:
    """A whole reply less its `content-length`, checked first against the body it heads (the
    ids' lengths differ by path)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    length = re.search(rb"\r\ncontent-length: (\d+)", head)
    assert length is not None, raw
    assert int(length.group(1)) == len(body), raw
    return re.sub(rb"\r\ncontent-length: \d+", b"", head) + b"\r\n\r\n" + body


async def streamed_on_both_paths(
    path: str, body: dict[str, Any], steps: int | None = None, **sections: Any
) -> list[tuple[str, dict[str, str], dict[str, Any]]]:
    """The streamed reply to `body` (its text and headers, a 200) from the native front, then
    from the Python path, each checked to be served where it should, and the body vLLM was
    sent; `steps`: the fake emits that many tokens once the request runs, then holds the
    rest. `sections`: the gateway's config over the harness's. Once the Python path is gone
    (`PYTHON_PATH`), the native front's alone."""
    replies = []
    server = sections.pop("server", {})
    for native in paths():
        async with start_gateway(server=server, native=native, **sections) as h:
            request = asyncio.create_task(read_stream(h.client, path, body))
            if steps is not None:
                await until(lambda h=h: h.fake.running == 1)
                h.fake.release(steps)
            status, text, headers = await asyncio.wait_for(request, 10)
            assert status == 200, text
            assert by_front(headers) == native
            h.fake.release(100)  # a held reply, cut: let the fake's own task end
            await until(lambda h=h: h.gateway.runtime.live == 0)
            replies.append((text, headers, h.fake.bodies[-1]))
    return replies


async def raw_on_both_paths(
    path: str, body: dict[str, Any], steps: int | None = None, **sections: Any
) -> list[tuple[bytes, dict[str, Any]]]:
    """The raw reply to `body` (its connection closed with it, read to the end) from the
    native front, then from the Python path, each checked to be served where it should, and
    the body vLLM was sent (`{}` if none); `steps` and `sections` as for
    `streamed_on_both_paths`; once the Python path is gone, the native front's alone."""
    replies = []
    server = sections.pop("server", {})
    for native in paths():
        async with start_gateway(server=server, native=native, **sections) as h:
            reader, writer = await connect(h.url, post(path, body, close=True))
            if steps is not None:
                await until(lambda h=h: h.fake.running == 1)
                h.fake.release(steps)
            raw = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            assert (reply_id(raw) >= NATIVE_IDS) == native, raw
            h.fake.release(100)  # a held reply, cut: let the fake's own task end
            await until(lambda h=h: h.gateway.runtime.live == 0)
            replies.append((raw, h.fake.bodies[-1] if h.fake.bodies else {}))
    return replies


async def refused_on_both_paths(
    path: str, held: dict[str, Any], body: dict[str, Any]
) -> list[tuple[bytes, tuple[int, str, dict[str, str]]]]:
    """The raw refusal of `body` (one slot, taken by `held`, which the fake holds, and no place
    to wait: a 429) from the native front, then from the Python path, and the held request's
    reply (`read_stream`'s) once the fake let it go on; once the Python path is gone, the
    native front's alone."""
    answers = []
    for native in paths():
        async with start_gateway(
            native=native,
            gate={"max_concurrency_per_gpu": 1, "queue": {"max_waiting": 0}},
        ) as h:
            hold = asyncio.create_task(read_stream(h.client, path, held))
            await until(lambda h=h: h.fake.running == 1)
            reader, writer = await connect(h.url, post(path, body, close=True))
            raw = await reader.read()
            writer.close()
            h.fake.release(10)
            answers.append((raw, await hold))
    return answers
