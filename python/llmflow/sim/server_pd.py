"""The simulated vLLM's KV connector: vLLM's prefill/decode hand-off (NIXL pull) over HTTP.

With `KvTransfer` given, `simserve` acts as a vLLM started with `NixlConnector` (`kv_role`
`kv_both`), as the toy proxy drives it (`tests/v1/kv_connector/nixl_integration/`):

1. a request whose `kv_transfer_params.do_remote_decode` is true runs with `Seq.hold_kv`: when
   it ends capped by its length (the proxy's `max_tokens` 1) its blocks stay allocated, and its
   JSON answer carries `kv_transfer_params` with `do_remote_prefill` true, `remote_block_ids`
   (a distinct run of ids per held request, counted up from 0), `remote_engine_id`,
   `remote_host`/`remote_port` (where the request came in, unless set) and `tp_size`;
2. a request whose `do_remote_prefill` is true with `remote_block_ids`, `remote_engine_id`,
   `remote_host` and `remote_port` runs with `Seq.remote_kv`: the engine admits it once the
   whole prompt's blocks fit (WAITING_FOR_REMOTE_KVS), then this module `POST`s
   `/_sim/kv/pull` to the prefill server, waits `bytes / bandwidth + latency` on this server's
   inbound link (FIFO, as `disagg.KvLink`), `POST`s `/_sim/kv/done` (NIXL's notification
   that the read is over: the prefill frees its blocks) and hands the request to the engine,
   which computes the last prompt token and decodes;
3. a pull that fails (no server, 404: unknown or freed blocks) is recomputed locally, as
   vLLM's default `kv_load_failure_policy` "recompute" does: the request goes back to the
   waiting queue and prefills its whole prompt;
4. blocks nobody reads are freed `hold_timeout_s` simulated seconds (÷ speed in wall time)
   after the prefill ended (`VLLM_NIXL_ABORT_REQUEST_TIMEOUT`).

A decode whose client leaves during the transfer is aborted at once (its blocks freed); the
transfer already on the wire still ends and notifies the prefill side, and one that leaves
before its read notifies at once (vLLM's connector does both, so no prefill KV is stranded).
Not modelled: NIXL's ZMQ handshake and RDMA (one HTTP side channel instead), heterogeneous TP
(`tp_size` is answered, never checked), the decode's own prefix cache before a pull.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import Request  # noqa: TC002 - FastAPI resolves route signatures at runtime
from fastapi.responses import JSONResponse, Response

from llmflow.sim.driver import Histogram
from llmflow.sim.sequence import LOADING

if TYPE_CHECKING:
    from collections.abc import Coroutine, MutableMapping

    from fastapi import FastAPI

    from llmflow.sim.driver import RealtimeEngine
    from llmflow.sim.engine import Seq

__all__ = ["KvConnector", "KvTransfer"]

XFER_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)  # s
BYTES_BUCKETS = tuple(2.0 ** k for k in range(11, 35, 2))  # 2 KiB .. 16 GiB
_PULL_TIMEOUT_S = 10.0  # wall seconds for the side channel to answer
_REMOTE_KEYS = ("remote_engine_id", "remote_host", "remote_port")


@dataclass(frozen=True)
class KvTransfer:
    """The KV connector's settings (vLLM's `--kv-transfer-config` with NixlConnector).

    Args:
        bandwidth_gb_s: this server's inbound KV link, GB/s (decimal).
        latency_ms: added to each transfer (setup, notification).
        hold_timeout_s: simulated seconds a prefill's blocks wait to be read before they are
            freed (vLLM's `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`).
        side_channel_host: `remote_host` in the answers (default: the address each request
            came in on; vLLM's `VLLM_NIXL_SIDE_CHANNEL_HOST`).
        side_channel_port: `remote_port` in the answers (default: the port it came in on).
        engine_id: `remote_engine_id` (default: a fresh UUID per server, as vLLM's).
    """

    bandwidth_gb_s: float = 25.0
    latency_ms: float = 1.0
    hold_timeout_s: float = 480.0
    side_channel_host: str | None = None
    side_channel_port: int | None = None
    engine_id: str | None = None

    def __post_init__(self) -> None:
        if self.bandwidth_gb_s <= 0 or self.latency_ms < 0 or self.hold_timeout_s <= 0:
            raise ValueError("the KV link needs bandwidth > 0, latency >= 0 and a hold "
                             "timeout > 0")


class _Held:
    """A prefill's blocks kept for a remote decode."""

    __slots__ = ("block_ids", "seq", "timer")

    def __init__(self, seq: Seq, first: int, timer: asyncio.TimerHandle):
        self.seq, self.timer = seq, timer
        self.block_ids = list(range(first, first + seq.blocks))


class KvConnector:
    """Both halves of the hand-off for one simulated server; see the module docstring.

    Args:
        spec: the link and timeout.
        state: the server's shared state (`engine` once started).
        tp: this server's tensor-parallel degree (`tp_size`; the bytes count each GPU's shard).
    """

    def __init__(self, spec: KvTransfer, state: MutableMapping[str, Any], tp: int):
        self.spec, self.state, self.tp = spec, state, tp
        self.engine_id = spec.engine_id or str(uuid.uuid4())
        self._held: dict[int, _Held] = {}  # by the first block id
        self._answers: dict[int, dict[str, Any]] = {}  # held rid -> its kv_transfer_params
        self._next_block = 0
        self._remote: dict[int, dict[str, Any]] = {}  # decode rid -> its prefill's params
        self._tasks: set[asyncio.Task[None]] = set()
        self._client: httpx.AsyncClient | None = None
        self._free_at = 0.0  # simulated s when the inbound link is free for the next transfer
        # prefill side
        self.pulls_served = self.bytes_sent = self.freed_read = self.freed_expired = 0
        # decode side
        self.failed = self.bytes_received = 0
        self.xfer_time = Histogram(XFER_BUCKETS)
        self.xfer_bytes = Histogram(BYTES_BUCKETS)

    @property
    def engine(self) -> RealtimeEngine:
        """The running engine."""
        engine: RealtimeEngine = self.state["engine"]
        return engine

    def start(self, engine: RealtimeEngine) -> None:
        """Hook into the engine (call once it exists, before it serves)."""
        engine.core.on_load = self._on_load
        engine.on_end = self._on_end
        self._client = httpx.AsyncClient(timeout=_PULL_TIMEOUT_S)

    async def close(self) -> None:
        """Cancel transfers and timers; close the side-channel client."""
        for task in list(self._tasks):
            task.cancel()
        for held in self._held.values():
            held.timer.cancel()
        if self._client is not None:
            await self._client.aclose()

    # ---- requests ------------------------------------------------------------------------

    @staticmethod
    def parse(body: dict[str, Any]) -> tuple[bool, dict[str, Any] | None]:
        """(hold its KV for a remote decode, its prefill's params to pull from) of a request.

        Raises:
            ValueError: `kv_transfer_params` is not an object.
        """
        params = body.get("kv_transfer_params")
        if params is None:
            return False, None
        if not isinstance(params, dict):
            raise ValueError("kv_transfer_params must be an object")
        remote = (bool(params.get("do_remote_prefill")) and bool(params.get("remote_block_ids"))
                  and all(params.get(k) is not None for k in _REMOTE_KEYS))
        return bool(params.get("do_remote_decode")), params if remote else None

    def expect(self, seq: Seq, params: dict[str, Any]) -> None:
        """Remember where a `remote_kv` request's KV is (before the engine can admit it)."""
        self._remote[seq.rid] = params

    def answer(self, seq: Seq, request: Request) -> dict[str, Any] | None:
        """The `kv_transfer_params` of a finished request's JSON answer."""
        params = self._answers.pop(seq.rid, None)
        if params is None:
            return None
        server = request.scope.get("server") or (None, None)
        return {**params, "remote_host": self.spec.side_channel_host or server[0],
                "remote_port": self.spec.side_channel_port or server[1]}

    # ---- prefill side --------------------------------------------------------------------

    def _on_end(self, seq: Seq) -> None:
        params = self._remote.pop(seq.rid, None)
        if params is not None:  # a decode aborted before it was admitted
            self._spawn(self._post(_side_channel(params, "done"), _ask(params)))
            return
        if seq.rid not in self.engine.core.kv_held:
            return
        if seq.finish_reason != "length" or seq.blocks == 0:  # vLLM frees these at once
            self._release(seq)
            return
        first = self._next_block
        self._next_block += seq.blocks
        timer = asyncio.get_running_loop().call_later(
            self.spec.hold_timeout_s / self.engine.speed, self._expire, first)
        held = self._held[first] = _Held(seq, first, timer)
        self._answers[seq.rid] = {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": held.block_ids, "remote_engine_id": self.engine_id,
            "remote_host": None, "remote_port": None, "tp_size": self.tp}

    def _expire(self, first: int) -> None:
        held = self._held.pop(first, None)
        if held is not None:
            self.freed_expired += 1
            self._answers.pop(held.seq.rid, None)
            self._release(held.seq)

    def _release(self, seq: Seq) -> None:
        self.engine.core.release(seq)
        self.engine.kick()  # freed blocks may let a waiting request in

    def _find(self, body: Any) -> _Held | None:
        if not isinstance(body, dict) or body.get("engine_id") != self.engine_id:
            return None
        ids = body.get("block_ids")
        held = self._held.get(ids[0]) if isinstance(ids, list) and ids else None
        return held if held is not None and held.block_ids == ids else None

    def _bytes(self, seq: Seq) -> int:
        return round(seq.prompt * self.engine.core.cost.kv_bytes_per_token * self.tp)

    async def pull(self, request: Request) -> Response:
        """`POST /_sim/kv/pull`: a decode reads held blocks (they stay held until `done`)."""
        held = self._find(await _json(request))
        if held is None:
            return _not_found()
        nbytes = self._bytes(held.seq)
        self.pulls_served += 1
        self.bytes_sent += nbytes
        return JSONResponse({"engine_id": self.engine_id, "blocks": len(held.block_ids),
                             "tokens": held.seq.prompt, "bytes": nbytes})

    async def done(self, request: Request) -> Response:
        """`POST /_sim/kv/done`: the read is over; free the blocks."""
        held = self._find(await _json(request))
        if held is None:
            return _not_found()
        del self._held[held.block_ids[0]]
        held.timer.cancel()
        self.freed_read += 1
        self._release(held.seq)
        return JSONResponse({"freed": len(held.block_ids)})

    # ---- decode side ---------------------------------------------------------------------

    def _on_load(self, seq: Seq) -> None:
        self._spawn(self._load(seq, self._remote.pop(seq.rid)))

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _load(self, seq: Seq, params: dict[str, Any]) -> None:
        ask = _ask(params)
        answer = await self._post(_side_channel(params, "pull"), ask)
        nbytes = answer.get("bytes") if answer is not None else None
        if not isinstance(nbytes, int) or nbytes < 0:
            self.failed += 1
            if seq.state == LOADING:
                self._recompute(seq)
            return
        engine = self.engine
        if seq.state == LOADING:  # else the client left while the pull was asked for
            start = max(engine.now(), self._free_at)
            self._free_at = start + nbytes / (self.spec.bandwidth_gb_s * 1e9)
            took = self._free_at + self.spec.latency_ms / 1000.0 - engine.now()  # disagg.KvLink
            await asyncio.sleep(max(0.0, took) / engine.speed)
            self.bytes_received += nbytes
            self.xfer_time.observe(took)
            self.xfer_bytes.observe(nbytes)
        # NIXL's notification: the read is over (or not wanted), the prefill frees its blocks
        await self._post(_side_channel(params, "done"), ask)
        if seq.state == LOADING:  # else aborted during the transfer: its blocks went then
            engine.core.loaded(seq)
            engine.kick()

    async def _post(self, url: str, body: dict[str, Any]) -> dict[str, Any] | None:
        assert self._client is not None
        try:
            r = await self._client.post(url, json=body)
            answer = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return answer if isinstance(answer, dict) else None

    def _recompute(self, seq: Seq) -> None:
        core, now = self.engine.core, self.engine.now()
        core.abort(seq, now)  # frees the blocks it was given for the KV
        seq.remote_kv, seq.finish_reason = False, ""
        core.add(seq, now)  # the same stream: the client sees a slower first token
        self.engine.kick()

    # ---- instruments ---------------------------------------------------------------------

    def render(self, labels: str) -> str:
        """Prometheus lines: vLLM's NIXL metrics (decode side) and llmflow's own."""
        core = self.engine.core
        lines: list[str] = []
        for name, kind, doc, value in (
            ("llmflow_sim_kv_held_blocks", "gauge",
             "KV blocks of ended prefills kept for a remote decode.",
             sum(s.blocks for s in core.kv_held.values())),
            ("llmflow_sim_kv_held_requests", "gauge",
             "Ended prefills whose KV waits to be read.", len(core.kv_held)),
            ("llmflow_sim_kv_pulls_served_total", "counter",
             "Pulls of held KV this server answered.", self.pulls_served),
            ("llmflow_sim_kv_bytes_sent_total", "counter",
             "KV bytes remote decodes pulled from this server.", self.bytes_sent),
            ("llmflow_sim_kv_loading_requests", "gauge",
             "Requests whose prompt KV is on its way (WAITING_FOR_REMOTE_KVS, blocks given).",
             len(core.loading)),
            ("llmflow_sim_kv_bytes_received_total", "counter",
             "KV bytes this server pulled from prefill servers.", self.bytes_received),
            ("vllm:nixl_num_failed_transfers_total", "counter",
             "Failed KV pulls (each recomputed locally).", self.failed),
        ):
            _family(lines, name, kind, doc)
            lines.append(f"{name}{{{labels}}} {float(value)}")
        name = "llmflow_sim_kv_freed_total"
        _family(lines, name, "counter", "Held KV freed: read by the decode, or timed out.")
        for why, n in (("read", self.freed_read), ("timeout", self.freed_expired)):
            lines.append(f'{name}{{{labels},reason="{why}"}} {float(n)}')
        for name, doc, h in (
            ("vllm:nixl_xfer_time_seconds", "KV transfer duration (simulated seconds).",
             self.xfer_time),
            ("vllm:nixl_bytes_transferred", "Bytes moved per KV transfer.", self.xfer_bytes),
        ):
            _family(lines, name, "histogram", doc)
            for le, c in h.cumulative():
                lines.append(f'{name}_bucket{{{labels},le="{le}"}} {c}')
            lines.append(f"{name}_sum{{{labels}}} {h.sum}")
            lines.append(f"{name}_count{{{labels}}} {float(h.count)}")
        return "\n".join(lines) + "\n"

    def install(self, app: FastAPI) -> None:
        """Add the side channel's routes to `app`."""
        app.add_api_route("/_sim/kv/pull", self.pull, methods=["POST"], include_in_schema=False)
        app.add_api_route("/_sim/kv/done", self.done, methods=["POST"], include_in_schema=False)


def _side_channel(params: dict[str, Any], what: str) -> str:
    return f"http://{params['remote_host']}:{params['remote_port']}/_sim/kv/{what}"


def _ask(params: dict[str, Any]) -> dict[str, Any]:
    return {"engine_id": params["remote_engine_id"], "block_ids": params["remote_block_ids"]}


def _family(lines: list[str], name: str, kind: str, doc: str) -> None:
    lines.append(f"# HELP {name} {doc}")
    lines.append(f"# TYPE {name} {kind}")


async def _json(request: Request) -> Any:
    with contextlib.suppress(ValueError):
        return await request.json()
    return None


def _not_found() -> JSONResponse:
    return JSONResponse({"error": {"message": "no such held KV blocks (unknown, or freed)",
                                   "type": "NotFoundError", "param": None, "code": 404}},
                        status_code=404)
