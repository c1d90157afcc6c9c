"""The uvicorn options that carry the gateway's limits, for the listeners uvicorn serves.

uvicorn serves the app on the private unix socket behind the native front door (`front.py`),
and the admin app on `admin.port`; both run `guard.py`'s protocol with the config's timeouts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llmflow.gateway.guard import GuardProtocol

if TYPE_CHECKING:
    from llmflow.config import Settings

__all__ = ["server_options"]


_PEER_HEADER_BYTES = 128  # `x-llmflow-peer: [IPv6]:port`, which the front door adds to a head
_PRIVATE_KEEP_ALIVE_S = 24 * 3600  # the front door closes idle connections, not uvicorn


def server_options(settings: Settings, behind_front: bool = False) -> dict[str, Any]:
    """The uvicorn options that carry the gateway's limits (`llmflow serve` and the tests).

    Args:
        settings: the validated config.
        behind_front: uvicorn serves the private unix socket behind the native front door
            (the app's listener), where the front bounds heads and idle connections already;
            False for a listener of its own on a port (the admin listener).

    Returns:
        Keyword arguments for `uvicorn.Config`: the guarded protocol, its header limit, and
        the largest WebSocket message (`server.max_body_bytes`, as for an HTTP body).
    """
    options: dict[str, Any] = {
        "http": GuardProtocol.configured(
            settings.server.read_timeout_ms / 1e3,
            write_timeout_s=settings.server.write_timeout_ms / 1e3,
        ),
        "h11_max_incomplete_event_size": settings.limits.max_header_bytes,
        "ws_max_size": settings.server.max_body_bytes,
    }
    if behind_front:  # the front refused larger heads already; its peer header must fit
        options["h11_max_incomplete_event_size"] += _PEER_HEADER_BYTES
        options["timeout_keep_alive"] = _PRIVATE_KEEP_ALIVE_S
    return options
