"""The gateway's listener: the uvicorn options that carry its limits and its fast path.

`handoff.py`'s protocol bounds what a connection may send and lends sockets to the relay;
`fastpath.py` answers a flood's refusals below FastAPI. This module joins the two for a
listener, so neither needs the other at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llmflow.gateway.fastpath import RefusalDesk
from llmflow.gateway.handoff import HandoffProtocol

if TYPE_CHECKING:
    from fastapi import FastAPI

    from llmflow.config import Settings

__all__ = ["server_options"]


_PEER_HEADER_BYTES = 128  # `x-llmflow-peer: [IPv6]:port`, which the front door adds to a head
_PRIVATE_KEEP_ALIVE_S = 24 * 3600  # the front door closes idle connections, not uvicorn


def server_options(
    settings: Settings, app: FastAPI | None = None, behind_front: bool = False
) -> dict[str, Any]:
    """The uvicorn options that carry the gateway's limits (`llmflow serve` and the tests).

    Args:
        settings: the validated config.
        app: the gateway's app (`create_app`), whose refusals this listener then answers
            below FastAPI (`fastpath.py`); None for a listener without completion routes.
        behind_front: uvicorn serves the private unix socket behind the native front door
            (`server.front: native`): the front bounds heads and idle connections, and a
            reply's socket is the front's, so it is not lent to the relay.

    Returns:
        Keyword arguments for `uvicorn.Config`: the hand-off protocol, its header limit, and
        the largest WebSocket message (`server.max_body_bytes`, as for an HTTP body).
    """
    refusals = RefusalDesk(app) if app is not None else None
    options: dict[str, Any] = {
        "http": HandoffProtocol.configured(
            settings.server.read_timeout_ms / 1e3,
            refusals,
            write_timeout_s=settings.server.write_timeout_ms / 1e3,
            lends=not behind_front,
        ),
        "h11_max_incomplete_event_size": settings.limits.max_header_bytes,
        "ws_max_size": settings.server.max_body_bytes,
    }
    if behind_front:  # the front refused larger heads already; its peer header must fit
        options["h11_max_incomplete_event_size"] += _PEER_HEADER_BYTES
        options["timeout_keep_alive"] = _PRIVATE_KEEP_ALIVE_S
    return options
