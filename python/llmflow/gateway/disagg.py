"""Prefill/decode disaggregation (experimental): the prefill hop of a split request.

When the runtime's `Start` names a `prefill_backend` (a model whose backends are split into
`role: prefill` and `role: decode` instances), the request goes to vLLM twice, as vLLM's own
P/D proxy sends it (`tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`):

1. to the prefill instance, not streamed, with `max_tokens` 1 and `kv_transfer_params` asking
   for a remote decode; vLLM's KV connector keeps the prompt's KV there and answers with the
   `kv_transfer_params` a decode instance needs to read it;
2. to `backend`, the decode instance, with the client's own body plus those parameters; its
   answer is the client's reply, relayed as any other.

Which instances, and when, is the runtime's (`Runtime.prefilled` frees the prefill slot);
this module only shapes the first request and reads its answer. Both hops carry the same
`X-Request-Id`, which connectors match the two sides by. The native front sends the same two
hops in Rust (`rust/src/front/disagg.rs` shapes them as this module does).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from llmflow.gateway.http1 import Connection
    from llmflow.gateway.types import Json
    from llmflow.gateway.upstream import Upstream

__all__ = ["decode_body", "prefill_body", "prefill_hop", "warn_unread"]

log = logging.getLogger("llmflow.gateway")

# What a prefill instance is asked for: compute the prompt, keep its KV for a remote decode.
_REMOTE_DECODE: Json = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Fields a prefill-only request must not carry (vLLM's proxy drops them: they concern the
# answer, which the decode instance writes).
_DECODE_ONLY = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_body(body: Json) -> Json:
    """The prefill hop's body: the decode's own, not streamed, one token, remote decode."""
    out = {k: v for k, v in body.items() if k not in _DECODE_ONLY}
    out.update(stream=False, max_tokens=1, kv_transfer_params=_REMOTE_DECODE)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: Json, kv_transfer_params: Json | None) -> Json:
    """The decode hop's body: the client's, with the prefill's KV transfer parameters (none:
    the prefill instance has no KV connector, and the decode instance computes the prompt).

    Only the prefill instance's answer sets them, never the client: a client's own would
    name the blocks and the host the decode instance's connector reads from.
    """
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if kv_transfer_params is not None:
        out["kv_transfer_params"] = kv_transfer_params
    return out


async def prefill_hop(
    upstream: Upstream,
    url: str,
    path: str,
    body: Json,
    request_id: str,
    on_connection: Callable[[Connection], None] | None = None,
) -> Json | None:
    """Send the prefill hop and return the `kv_transfer_params` it answered (None if absent).

    Raises:
        UpstreamError: the prefill instance is unreachable or answered an error status.
    """
    answer = await upstream.post_json(url, path, prefill_body(body), request_id, on_connection)
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not isinstance(params, dict):
        warn_unread(url, request_id)
        return None
    return params


def warn_unread(url: str, request_id: str) -> None:
    """Log that the prefill instance at `url` answered `request_id` without KV transfer
    parameters (the native front's hops are logged here too, from their records)."""
    log.warning(
        "prefill instance %s answered %s without kv_transfer_params: is vLLM's KV connector "
        "configured (--kv-transfer-config)? The decode instance computes the prompt again.",
        url, request_id,
    )
