"""Prefill/decode disaggregation: a request's hand-off from a prefill pool to a decode pool.

It follows vLLM's disaggregated serving with a pull connector (NIXL), as its toy proxy drives
it (`tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`). `Handoff` holds the
mechanics, one `Hop` per request; its host picks the instances:

1. the host sends the request to a prefill instance with `max_tokens` 1 and waits for the
   whole (unstreamed) answer; the prefill engine schedules it as any request, and when it
   ends its KV blocks are kept (the connector's delayed free, `Seq.hold_kv`);
2. the host then sends it to a decode instance and streams that instance's answer to the
   client: the client's first token is the decode's first token;
3. the decode engine admits it once the whole prompt's blocks fit (`EngineCore`'s
   `remote_kv` path: vLLM's WAITING_FOR_REMOTE_KVS); a request that does not fit waits in
   its queue. The blocks are allocated at admission and the transfer starts;
4. the transfer takes `prompt * kv_bytes_per_token * tp / bandwidth + latency` on the decode
   instance's inbound link. Each link is a FIFO: a transfer starts when the one before has
   left the wire (the latency overlaps the next transfer). When it arrives the prefill
   instance frees its blocks, and the decode engine computes the last prompt token (vLLM
   recomputes it), which samples the first output token.

An abort (a client that leaves, a deadline) ends the request where it is; during the transfer
it frees both sides at once (vLLM's prefill side would keep its blocks until a timeout).

Two hosts: `PdProxy` is the `direct` policy, vLLM's toy proxy with its own choice rules (round
robin prefill, least-KV decode); `GatedPolicy` (`sim/policies.py`) runs the instances the core
chose (`Start.prefill_backend`, `Start.backend`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from llmflow.sim.clients import CANCELLED, COMPLETED, ERROR
from llmflow.sim.engine import EngineError, Seq
from llmflow.sim.sequence import LOADING

if TYPE_CHECKING:
    from collections.abc import Callable

    import simpy

    from llmflow.sim.clients import Attempt
    from llmflow.sim.cluster import Backend, Cluster
    from llmflow.sim.scenario import Link

__all__ = ["Handoff", "Hop", "HopHost", "KvLink", "PdProxy"]


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


class HopHost(Protocol):
    """Who drives a `Hop`: picks its decode instance and hears its decode's events."""

    def prefilled(self, hop: Hop, now: float) -> None:
        """The prefill answered (not called once the hop was aborted): send the decode."""

    def first_token(self, att: Attempt, now: float) -> None:
        """The decode's first token (`att.t_sched` is set: the prefill's admission)."""

    def finished(self, att: Attempt, seq: Seq, now: float) -> None:
        """The decode ended."""

    def tokens_reached(self, att: Attempt, now: float) -> None:
        """The decode reached its `notify_at` (a stalled client's window is full)."""


class Hop:
    """One request's way through the split: its prefill, then its decode (`Seq` owner of
    both)."""

    __slots__ = ("aborted", "att", "decode", "dseq", "host", "pblocks", "prefill", "pseq")

    def __init__(self, host: HopHost, att: Attempt, prefill: Backend, pseq: Seq):
        self.host, self.att, self.prefill, self.pseq = host, att, prefill, pseq
        self.decode: Backend | None = None
        self.dseq: Seq | None = None
        self.pblocks = 0  # blocks of its prompt counted against the decode while it waits
        self.aborted = False

    def on_first_token(self, seq: Seq, now: float) -> None:
        if seq is self.dseq:
            self.att.t_sched = self.pseq.t_sched  # its wait: the prefill queue's
            self.host.first_token(self.att, now)

    def on_finished(self, seq: Seq, now: float) -> None:
        if seq is not self.pseq:
            self.host.finished(self.att, seq, now)
        elif self.aborted:  # aborted while its answer was on its way: the KV is not read
            self.prefill.core.release(seq)
            self.prefill.kick()
        else:
            self.host.prefilled(self, now)

    def on_tokens_reached(self, seq: Seq, now: float) -> None:
        if seq is self.dseq:
            self.host.tokens_reached(self.att, now)


class Handoff:
    """The hand-off mechanics on a split cluster: prefill, decode, the KV links, aborts.

    Args:
        env: the simulation environment.
        cluster: backends with `role` prefill or decode.
    """

    def __init__(self, env: simpy.Environment, cluster: Cluster):
        self.env = env
        self.prefills = [b for b in cluster.backends if b.role == "prefill"]
        self.decodes = [b for b in cluster.backends if b.role == "decode"]
        self.links: dict[str, KvLink] = {}
        self.asked: dict[str, int] = {}  # blocks of prompts sent to a decode, not yet admitted
        self._waiting: dict[int, Hop] = {}  # by decode sequence id, until admitted
        for b in self.decodes:
            assert b.link is not None  # scenario validation requires it
            self.links[b.name] = KvLink(env, b.link)
            self.asked[b.name] = 0
            b.core.on_load = self._loader(b)

    def prefill(self, host: HopHost, att: Attempt, p: Backend, pseq: Seq) -> Hop:
        """Step 1: send `pseq` (`max_tokens` 1) to the prefill instance `p`.

        Raises:
            EngineError: the prefill engine refused it (too long for its `max_model_len`).
        """
        pseq.hold_kv = True
        hop = Hop(host, att, p, pseq)
        pseq.owner = hop
        p.submit(pseq)
        return hop

    def decode(self, hop: Hop, d: Backend, dseq: Seq) -> None:
        """Step 2: the prefill answered; send `dseq` (`remote_kv`) to the decode instance `d`.

        Raises:
            EngineError: the decode engine refused it (the prefill's blocks are freed).
        """
        dseq.owner, dseq.remote_kv = hop, True
        hop.decode, hop.dseq = d, dseq
        try:
            d.submit(dseq)
        except EngineError:  # too long for the decode's max_model_len: its 400
            self._release(hop)
            raise
        hop.pblocks = -(-dseq.prompt // d.core.block_size)
        self.asked[d.name] += hop.pblocks
        self._waiting[dseq.rid] = hop

    def drop(self, hop: Hop) -> None:
        """The prefill answered but no decode follows: free the prefill's blocks."""
        self._release(hop)

    def abort(self, hop: Hop) -> None:
        """Abort the request where it is: its prefill, its wait for decode blocks, its
        transfer (both sides freed) or its decode."""
        hop.aborted = True
        if hop.dseq is None:
            hop.prefill.abort(hop.pseq)  # still prefilling (or its answer is on its way)
            return
        d = hop.decode
        assert d is not None
        if self._waiting.pop(hop.dseq.rid, None) is not None:  # waiting for decode blocks
            self.asked[d.name] -= hop.pblocks
            self._release(hop)
        elif hop.dseq.state == LOADING:  # in transfer
            self._release(hop)
        d.abort(hop.dseq)

    def _loader(self, d: Backend) -> Callable[[Seq], None]:
        def load(dseq: Seq) -> None:
            self._transfer(d, dseq)

        return load

    def _transfer(self, d: Backend, dseq: Seq) -> None:
        """Steps 3-4: the decode engine allocated the prompt's blocks; the KV moves."""
        hop = self._waiting.pop(dseq.rid)
        self.asked[d.name] -= hop.pblocks
        nbytes = dseq.prompt * d.core.cost.kv_bytes_per_token * d.gpus
        arrive = self.links[d.name].book(nbytes)
        ev = self.env.timeout(arrive - self.env.now)
        ev.callbacks.append(lambda _ev: self._arrived(hop))

    def _arrived(self, hop: Hop) -> None:
        dseq, d = hop.dseq, hop.decode
        assert dseq is not None
        assert d is not None
        if dseq.state != LOADING:  # aborted on the way: both sides were freed then
            return
        self._release(hop)
        d.core.loaded(dseq)
        d.kick()

    def _release(self, hop: Hop) -> None:
        hop.prefill.core.release(hop.pseq)
        hop.prefill.kick()  # freed blocks may let a waiting prefill in


class PdProxy:
    """The `direct` policy on a disaggregated cluster: vLLM's P/D proxy, no gateway.

    Its choice rules are the proxy's: prefill round robin (as the toy proxy does), decode on
    the instance with the least KV in use or asked for (its blocks, plus the prompts it was
    sent that wait for blocks; the toy proxy uses round robin).

    Args:
        env: the simulation environment.
        cluster: backends with `role` prefill or decode.
        propagate_disconnect: a client's disconnect aborts its request in vLLM.
    """

    def __init__(self, env: simpy.Environment, cluster: Cluster, propagate_disconnect: bool = True):
        self.env, self.propagate = env, propagate_disconnect
        self.handoff = Handoff(env, cluster)
        self._rr = 0
        self._ids = 0

    def next_id(self) -> int:
        """A fresh request id."""
        self._ids += 1
        return self._ids

    def send(self, att: Attempt) -> None:
        """Step 1: the prefill, with `max_tokens` 1, on the next prefill instance in turn."""
        prefills = self.handoff.prefills
        p = prefills[self._rr]
        self._rr = (self._rr + 1) % len(prefills)
        pseq = Seq(self.next_id(), att.req.prompt, 1)
        att.seq, att.backend, att.t_admit = pseq, p, self.env.now
        try:
            att.handler = self.handoff.prefill(self, att, p, pseq)
        except EngineError as exc:
            att.end(ERROR, reason=str(exc))

    def prefilled(self, hop: Hop, now: float) -> None:
        """Step 2: the prefill answered; send the decode to the least loaded decode instance."""
        att = hop.att
        if att.ended:  # the client left while it prefilled
            self.handoff.drop(hop)
            return
        d = min(self.handoff.decodes, key=self._kv_load)
        req = att.req
        dseq = Seq(self.next_id(), req.prompt, req.max_tokens, req.eos, 0, None, att.stop_after)
        att.seq, att.backend = dseq, d
        try:
            self.handoff.decode(hop, d, dseq)
        except EngineError as exc:
            att.end(ERROR, reason=str(exc))

    def _kv_load(self, b: Backend) -> float:
        c = b.core
        return (c.used + self.handoff.asked[b.name]) / c.cap

    def first_token(self, att: Attempt, now: float) -> None:
        """The decode's first token reached the client."""
        att.got_first(now)

    def finished(self, att: Attempt, seq: Seq, now: float) -> None:
        """The decode ended."""
        if not att.ended:
            att.end(CANCELLED if seq.finish_reason == "abort" else COMPLETED, tokens=seq.gen)

    def tokens_reached(self, att: Attempt, now: float) -> None:
        """Never asked for: vLLM ignores a stalled reader."""

    def cancel(self, att: Attempt) -> None:
        """Client disconnect: abort where the request is (unless disconnects do not reach
        vLLM)."""
        hop: Hop | None = att.handler  # type: ignore[assignment]
        if self.propagate and hop is not None:
            self.handoff.abort(hop)
