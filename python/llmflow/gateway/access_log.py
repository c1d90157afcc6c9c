"""The access log (`server.access_log`): one CSV row per request, at its end.

The columns are the simulator's per-request rows (`llmflow.request_log.COLUMNS`), so that a
real day can sit beside a simulated one and be replayed in the simulator (`arrival: {kind:
trace, path: access.csv}`). Times are Unix seconds; `class` is the tenant's tier; `attempts` is
1 (a client's retry is a request of its own); `prompt_tokens` is the count the core planned with
(exact for token ids, estimated for text). The outcome follows the simulator's vocabulary, from
the runtime's terminal action as the session recorded it. Each row is written (one write) when
its request ends.
"""

from __future__ import annotations

import csv
import time
from typing import TYPE_CHECKING

from llmflow.gateway.errors import GatewayError
from llmflow.request_log import COLUMNS, format_row

if TYPE_CHECKING:
    from pathlib import Path

    from llmflow.gateway.session import Prepared, StreamSession

__all__ = ["AccessLog", "outcome_of"]

_TIMED_OUT = frozenset(("deadline", "first_token_timeout", "queue_timeout", "timeout"))
_REFUSED_503 = frozenset(("draining", "no_healthy_backend"))  # refusals, not waits that expired


class AccessLog:
    """Appends request rows to a CSV file (the header first, when the file is new).

    Args:
        path: the file (`server.access_log`).
        shadow: shadow mode (`gate.mode: shadow`): a last column, `shadow`, says what the
            policy would have done (`Verdict.summary`: `queue>start`, `refuse:queue_full`...).
    """

    def __init__(self, path: Path, shadow: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # line-buffered: a row is in the file when its request has ended (a crash loses none)
        self._file = path.open("a", buffering=1, newline="", encoding="utf-8")
        self._csv = csv.writer(self._file)
        self._shadow = shadow
        if self._file.tell() == 0:
            self._csv.writerow((*COLUMNS, "shadow") if shadow else COLUMNS)
        # monotonic stamps (the sessions') to Unix time
        self._epoch = time.time() - time.monotonic()

    def refused(self, prepared: Prepared, error: GatewayError, at: float | None = None) -> None:
        """A request the runtime (or validation) refused as it arrived (`at`: when, monotonic;
        now if None)."""
        now = at + self._epoch if at is not None else time.time()
        self._write(
            (
                error.headers.get("X-Request-Id"),
                prepared.tier,
                prepared.tenant,
                prepared.arrived + self._epoch,
                1,
                None,
                None,
                now,
                prepared.prompt_tokens,
                prepared.max_tokens,
                0,
                _by_status(error.status, error.code),
                error.code,
                None,
            ),
            None,
        )

    def ended(self, session: StreamSession) -> None:
        """A session is over (served, cut, refused from the queue, or left by its client)."""
        p, epoch = session.prepared, self._epoch
        started = session.backend is not None
        first = session.first_token_at
        outcome, reason = _outcome(session)
        self._write(
            (
                f"llmflow-{session.request_id}",
                p.tier,
                p.tenant,
                p.arrived + epoch,
                1,
                p.arrived + session.queue_wait_s + epoch if started else None,
                first + epoch if first is not None else None,
                session.ended_at + epoch if session.ended_at is not None else time.time(),
                p.prompt_tokens,
                p.max_tokens,
                session.parser.completion_tokens,
                outcome,
                reason,
                session.backend,
            ),
            session.shadow.summary() if session.shadow is not None else None,
        )

    def _write(self, row: tuple[object, ...], shadow: str | None) -> None:
        cells = format_row(row)
        if self._shadow:
            cells.append(shadow or "")
        self._csv.writerow(cells)  # line-buffered: one write per request, no timer

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def _by_status(status: int, reason: str) -> str:
    if status == 429 or (status == 503 and reason in _REFUSED_503):
        return "rejected"
    if status in (503, 504):
        return "timed_out"
    return "failed"


def outcome_of(session: StreamSession) -> tuple[str, str | None]:
    """A session's outcome in the simulator's words (`completed`, `rejected`, `timed_out`,
    `truncated`, `cancelled`, `failed`) and its reason (the access log's, the span's)."""
    return _outcome(session)


def _outcome(session: StreamSession) -> tuple[str, str | None]:
    end = session.end
    if end == "completed":
        return "completed", None
    error = session.error
    if error is None and session.admitted.done() and not session.admitted.cancelled():
        exc = session.admitted.exception()
        error = exc if isinstance(exc, GatewayError) else None
    if error is not None:
        return _by_status(error.status, end), end
    if end in ("deadline", "shutdown") and session.parser.completion_tokens:
        return "truncated", end  # partial text and a notice
    if end in _TIMED_OUT:
        return "timed_out", end
    if end in ("upstream_error", "error"):
        return "failed", end
    return "cancelled", end
