"""Client signals: what a request's headers say about its client, read for the runtime.

Clients already say whether a request is a retry and how long they will wait for it. The OpenAI
and Anthropic SDKs send `x-stainless-retry-count` (the retries before this attempt: 0, 1, ...)
and their timeout in seconds (`x-stainless-timeout`, whole seconds from the JS SDKs; the OpenAI
Python SDK's `x-stainless-read-timeout`, e.g. `600.0`); Envoy sends `x-envoy-attempt-count` (this
attempt's number, from 1). A client may also set ours, `x-llmflow-deadline-ms`: how many
milliseconds it waits, which wins over an SDK's timeout.

Reading them is host I/O and decides nothing: the values go to the runtime with the arrival
(`Runtime.arrive(retries=, deadline_ms=)`), which bounds them by the `signals:` config and
decides (a retry keeps its first arrival's place; a client deadline the queue cannot meet is
refused at once, 429 `client_deadline`). A header we do not own that does not parse (not a
number, negative, not finite, absurdly large) is ignored, as if absent: the client did not
write it, and failing its request for a proxy's or SDK's header would help nobody. Ours is
the client's own: a malformed `x-llmflow-deadline-ms` is a 400 that says what to send.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmflow.gateway.errors import GatewayError

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["DEADLINE_HEADER", "NO_SIGNALS", "ClientSignals", "read_signals"]

DEADLINE_HEADER = b"x-llmflow-deadline-ms"  # ours: ms the client waits, from sending
_RETRY_COUNT = b"x-stainless-retry-count"  # SDKs: retries before this attempt (0 first)
_ATTEMPT_COUNT = b"x-envoy-attempt-count"  # Envoy: this attempt's number (1 first)
_TIMEOUTS = (b"x-stainless-timeout", b"x-stainless-read-timeout")  # SDKs: seconds
_MAX_COUNT = 1_000_000  # a larger count is no SDK's or proxy's: ignored
_MAX_DEADLINE_MS = 86_400_000  # a day; a longer wait is no deadline at all: ignored


@dataclass(frozen=True, slots=True)
class ClientSignals:
    """What a request's client said of it (`None`: nothing, or nothing usable)."""

    retries: int | None = None  # retries it made before this attempt
    deadline_ms: int | None = None  # how long after sending it gives up waiting


NO_SIGNALS = ClientSignals()


def read_signals(headers: Iterable[tuple[bytes, bytes]]) -> ClientSignals:
    """The signals in a request's raw headers (lower-case names, as ASGI and httptools give).

    Raises:
        GatewayError: 400, `x-llmflow-deadline-ms` is not a whole number of milliseconds in
            1..86,400,000.
    """
    retries: int | None = None
    deadline_ms: int | None = None
    timeout_ms: int | None = None
    for name, value in headers:
        if name == _RETRY_COUNT:
            retries = _most(retries, _count(value))
        elif name == _ATTEMPT_COUNT:
            attempt = _count(value)
            retries = _most(retries, attempt - 1 if attempt else None)
        elif name in _TIMEOUTS:
            timeout_ms = timeout_ms if timeout_ms is not None else _seconds_ms(value)
        elif name == DEADLINE_HEADER:
            deadline_ms = _own_deadline(value)
    return ClientSignals(retries, deadline_ms if deadline_ms is not None else timeout_ms)


def _most(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def _count(value: bytes) -> int | None:
    text = value.strip()
    if not text.isdigit() or len(text) > 7:
        return None
    n = int(text)
    return n if n <= _MAX_COUNT else None


def _seconds_ms(value: bytes) -> int | None:
    try:
        seconds = float(value.strip().decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None
    # A finite number of seconds can still overflow as milliseconds (1e306): ignored too.
    if not math.isfinite(seconds * 1000) or seconds <= 0:
        return None
    ms = round(seconds * 1000)
    return ms if 0 < ms <= _MAX_DEADLINE_MS else None


def _own_deadline(value: bytes) -> int:
    text = value.strip()
    if text.isdigit() and len(text) <= 8 and 0 < int(text) <= _MAX_DEADLINE_MS:
        return int(text)
    shown = text[:40].decode("latin-1")
    raise GatewayError(
        400,
        f"x-llmflow-deadline-ms must be a whole number of milliseconds from 1 to "
        f"{_MAX_DEADLINE_MS} (how long the client waits for the answer), got {shown!r}",
        "invalid_deadline",
        param="x-llmflow-deadline-ms",
    )
