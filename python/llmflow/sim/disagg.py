"""Prefill/decode disaggregation: a proxy in front of a prefill pool and a decode pool.

It follows vLLM's disaggregated serving with a pull connector (NIXL), as its toy proxy drives
it (`tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`):

1. the proxy sends the request to a prefill instance (round robin) with `max_tokens` 1 and
   waits for the whole (unstreamed) answer; the prefill engine schedules it as any request,
   and when it ends its KV blocks are kept (the connector's delayed free, `Seq.hold_kv`);
2. the proxy then sends it to the decode instance with the least KV in use or asked for
   (its blocks, plus the prompts it was sent that wait for blocks), and streams that
   instance's answer to the client: the client's first token is the decode's first token;
3. the decode engine admits it once the whole prompt's blocks fit (`EngineCore`'s
   `remote_kv` path: vLLM's WAITING_FOR_REMOTE_KVS); a request that does not fit waits in
   its queue. The blocks are allocated at admission and the transfer starts;
4. the transfer takes `prompt * kv_bytes_per_token * tp / bandwidth + latency` on the decode
   instance's inbound link. Each link is a FIFO: a transfer starts when the one before has
   left the wire (the latency overlaps the next transfer). When it arrives the prefill
   instance frees its blocks, and the decode engine computes the last prompt token (vLLM
   recomputes it), which samples the first output token.

A client that leaves aborts its request where it is; an abort during the transfer frees both
sides at once (vLLM's prefill side would keep its blocks until a timeout).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmflow.sim.clients import CANCELLED, COMPLETED, ERROR
from llmflow.sim.engine import EngineError, Seq
from llmflow.sim.sequence import LOADING

if TYPE_CHECKING:
    from collections.abc import Callable

    import simpy

    from llmflow.sim.clients import Attempt
    from llmflow.sim.cluster import Backend, Cluster
    from llmflow.sim.scenario import Link

__all__ = ["KvLink", "PdProxy"]


class KvLink:
    """One decode instance's inbound KV link: transfers one after another (FIFO).

    Args:
        env: the simulation environment.
        spec: bandwidth and latency.
    """

    def __init__(self, env: simpy.Environment, spec: Link):
        self.env = env
        self.bandwidth = spec.bandwidth_gb_s * 1e9  # bytes/s
        self.latency = spec.latency_ms / 1000.0  # s
        self.free_at = 0.0  # when the wire is free for the next transfer
        self.bytes = 0.0  # carried so far

    def book(self, nbytes: float) -> float:
        """Queue a transfer of `nbytes`; returns when it arrives (simulated s)."""
        start = max(self.env.now, self.free_at)
        self.free_at = start + nbytes / self.bandwidth
        self.bytes += nbytes
        return self.free_at + self.latency


class _Leg:
    """One request's way through the split: its prefill, then its decode."""

    __slots__ = ("att", "decode", "dseq", "pblocks", "prefill", "proxy", "pseq")

    def __init__(self, proxy: PdProxy, att: Attempt, prefill: Backend, pseq: Seq):
        self.proxy, self.att, self.prefill, self.pseq = proxy, att, prefill, pseq
        self.decode: Backend | None = None
        self.dseq: Seq | None = None
        self.pblocks = 0  # blocks of its prompt counted against the decode while it waits

    # the engines' owner callbacks (`SeqOwner`), for both of its sequences

    def on_first_token(self, seq: Seq, now: float) -> None:
        if seq is self.dseq:
            self.att.t_sched = self.pseq.t_sched  # its wait: the prefill queue's
            self.att.got_first(now)

    def on_finished(self, seq: Seq, now: float) -> None:
        if seq is self.pseq:
            self.proxy.prefilled(self)
        elif not self.att.ended:
            self.att.end(CANCELLED if seq.finish_reason == "abort" else COMPLETED, tokens=seq.gen)

    def on_tokens_reached(self, seq: Seq, now: float) -> None:
        """Never asked for: vLLM ignores a stalled reader."""


class PdProxy:
    """The `direct` policy on a disaggregated cluster: vLLM's P/D proxy, no gateway.

    Args:
        env: the simulation environment.
        cluster: backends with `role` prefill or decode.
        propagate_disconnect: a client's disconnect aborts its request in vLLM.
    """

    def __init__(self, env: simpy.Environment, cluster: Cluster, propagate_disconnect: bool = True):
        self.env, self.propagate = env, propagate_disconnect
        self.prefill = [b for b in cluster.backends if b.role == "prefill"]
        self.decode = [b for b in cluster.backends if b.role == "decode"]
        self.links: dict[str, KvLink] = {}
        self._asked: dict[str, int] = {}  # blocks of prompts sent to a decode, not yet admitted
        self._legs: dict[int, _Leg] = {}  # by decode sequence id, until admitted
        for b in self.decode:
            assert b.link is not None  # scenario validation requires it
            self.links[b.name] = KvLink(env, b.link)
            self._asked[b.name] = 0
            b.core.on_load = self._loader(b)
        self._rr = 0
        self._ids = 0

    def next_id(self) -> int:
        """A fresh request id."""
        self._ids += 1
        return self._ids

    def send(self, att: Attempt) -> None:
        """Step 1: the prefill, with `max_tokens` 1, on the next prefill instance in turn."""
        p = self.prefill[self._rr]
        self._rr = (self._rr + 1) % len(self.prefill)
        pseq = Seq(self.next_id(), att.req.prompt, 1)
        pseq.hold_kv = True
        leg = _Leg(self, att, p, pseq)
        pseq.owner = leg
        att.seq, att.backend, att.t_admit, att.handler = pseq, p, self.env.now, leg
        try:
            p.submit(pseq)
        except EngineError as exc:
            att.end(ERROR, reason=str(exc))

    def prefilled(self, leg: _Leg) -> None:
        """Step 2: the prefill answered; send the decode to the least loaded decode instance."""
        att = leg.att
        if att.ended:  # the client left while it prefilled
            self._release(leg)
            return
        d = min(self.decode, key=self._kv_load)
        req = att.req
        dseq = Seq(self.next_id(), req.prompt, req.max_tokens, req.eos, 0, leg, att.stop_after)
        dseq.remote_kv = True
        leg.decode, leg.dseq = d, dseq
        att.seq, att.backend = dseq, d
        try:
            d.submit(dseq)
        except EngineError as exc:  # too long for the decode's max_model_len: its 400
            self._release(leg)
            att.end(ERROR, reason=str(exc))
            return
        leg.pblocks = -(-req.prompt // d.core.block_size)
        self._asked[d.name] += leg.pblocks
        self._legs[dseq.rid] = leg

    def _kv_load(self, b: Backend) -> float:
        c = b.core
        return (c.used + self._asked[b.name]) / c.num_blocks

    def _loader(self, d: Backend) -> Callable[[Seq], None]:
        def load(dseq: Seq) -> None:
            self._transfer(d, dseq)

        return load

    def _transfer(self, d: Backend, dseq: Seq) -> None:
        """Steps 3-4: the decode engine allocated the prompt's blocks; the KV moves."""
        leg = self._legs.pop(dseq.rid)
        self._asked[d.name] -= leg.pblocks
        nbytes = dseq.prompt * d.core.cost.kv_bytes_per_token * d.gpus
        arrive = self.links[d.name].book(nbytes)
        ev = self.env.timeout(arrive - self.env.now)
        ev.callbacks.append(lambda _ev: self._arrived(leg))

    def _arrived(self, leg: _Leg) -> None:
        dseq, d = leg.dseq, leg.decode
        assert dseq is not None
        assert d is not None
        if dseq.state != LOADING:  # aborted on the way: both sides were freed then
            return
        self._release(leg)
        d.core.loaded(dseq)
        d.kick()

    def _release(self, leg: _Leg) -> None:
        leg.prefill.core.release(leg.pseq)
        leg.prefill.kick()  # freed blocks may let a waiting prefill in

    def cancel(self, att: Attempt) -> None:
        """Client disconnect: abort where the request is (unless disconnects do not reach
        vLLM)."""
        if not self.propagate:
            return
        leg: _Leg | None = att.handler  # type: ignore[assignment]
        if leg is None:
            return
        if leg.dseq is None:
            leg.prefill.abort(leg.pseq)  # still prefilling (or its answer is on its way)
            return
        d = leg.decode
        assert d is not None
        if self._legs.pop(leg.dseq.rid, None) is not None:  # waiting for decode blocks
            self._asked[d.name] -= leg.pblocks
            self._release(leg)
        elif leg.dseq.state == LOADING:  # in transfer
            self._release(leg)
        d.abort(leg.dseq)
