"""The measurements behind `llmflow calibrate`: the sweeps, the traces, the fitted profile.

Two sweeps and a join over the OpenAI API, streaming, with random token-id prompts (so vLLM's
prefix cache never hits) and `ignore_eos` (so every request runs to `max_tokens`):

* prefill: single requests on an idle engine at several prompt lengths; the time to the first
  token is one prefill step plus the frontend path (HTTP, IPC, detokenising);
* decode: batches of `B` requests with `C`-token prompts started together; while every one of
  them is decoding, the time per generated token is the engine's step time for `B` decodes over
  about `B * (C + tokens so far)` context tokens;
* mixed: a prompt sent while a batch decodes; the batch's extra time across its arrival is the
  one step that computed the prompt among the decodes.

`llmflow.sim.profile.fit_step_model` fits the step model to all three. Engine limits come from
`/v1/models` (`max_model_len`) and vLLM's `vllm:cache_config_info` (`block_size`,
`num_gpu_blocks`); `Calibration.engine` adds the limits vLLM does not publish.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import httpx

from llmflow.gateway.http1 import ConnectionPool
from llmflow.sim.profile import (
    DecodeSample,
    MixedSample,
    PrefillSample,
    Profile,
    fit_step_model,
)

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["Calibration", "Trace", "calibrate", "decode_sample", "mixed_sample", "stream_request"]

_TOKEN_IDS = (100, 4000)  # random prompt ids drawn from this range (valid in any >=4k vocab)
_WINDOW_EDGE = 2  # tokens ignored at each end of the all-decoding window
_MIN_WINDOW = 8  # fewest tokens a request must make in the window to count
_SETTLE_S = 0.05  # pause between probes so the engine is idle when the next starts
_MIXED_CONTEXT, _MIXED_TOKENS = 32, 96  # the decoding batch a prompt joins: prompt, output
# the prompt joins once every decoder has streamed this many chunks: decoding, with steps before
# the join to time (mixed_sample needs five), and far from its end. Waiting on the batch's own
# progress, not on a fixed time, holds on a backend slowed by a busy machine.
_JOIN_AFTER_CHUNKS = 8
_JOIN_SPAN = 6  # decoder tokens timed across a prompt's arrival: one of their steps holds it
_KV_HEADROOM = 0.9  # probes must fit in this share of the usable KV blocks (no preemption)
_HEAD = b"content-type: application/json\r\naccept: text/event-stream\r\n"
_LABEL = re.compile(r'(\w+)="([^"]*)"')


@dataclass
class Trace:
    """One streamed request as the client saw it: when it was sent, when each chunk came."""

    prompt_tokens: int
    sent: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens so far)

    @property
    def ttft_s(self) -> float:
        """Seconds from sending to the first token."""
        return self.chunks[0][0] - self.sent


@dataclass
class Calibration:
    """What to measure.

    Args:
        url: the backend's base URL (without `/v1`).
        model: the served model name (None: the first one `/v1/models` lists).
        prompt_lengths: prompt sizes of the prefill sweep.
        repeats: requests per prompt size.
        concurrency: batch sizes of the decode sweep.
        contexts: prompt sizes of the decode sweep (each run with every batch size whose
            requests fit in the KV cache: `batches` once the backend's limits are known).
        decode_tokens: tokens each decode-sweep request generates.
        decode_repeats: runs of each decode batch.
        mixed_prompts: prompt sizes that join a decoding batch (`repeats` times each).
        mixed_decodes: size of that batch.
        engine: limits to record that vLLM does not publish (`max_num_seqs`, ...).
        seed: seeds the random prompts (None: fresh ones; a repeated seed would hit vLLM's
            prefix cache and time cached prompts).
    """

    url: str
    model: str | None = None
    prompt_lengths: tuple[int, ...] = (16, 128, 384, 768, 1152, 1536)
    repeats: int = 3
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)
    contexts: tuple[int, ...] = (32, 640, 1280)
    decode_tokens: int = 64
    decode_repeats: int = 2
    mixed_prompts: tuple[int, ...] = (128, 512, 1024)
    mixed_decodes: int = 8
    engine: dict[str, int] = field(default_factory=dict)
    seed: int | None = None
    batches: tuple[tuple[int, int], ...] | None = None  # (context, batch size); None: all

    def decode_batches(self) -> tuple[tuple[int, int], ...]:
        """The decode sweep's (context, batch size) pairs."""
        if self.batches is not None:
            return self.batches
        return tuple((c, b) for c in self.contexts for b in self.concurrency)

    def probes(self) -> int:
        """Requests in both sweeps (for a progress bar)."""
        decode = sum(b for _, b in self.decode_batches()) * self.decode_repeats
        mixed = len(self.mixed_prompts) * self.repeats * (self.mixed_decodes + 1)
        return len(self.prompt_lengths) * self.repeats + decode + mixed


async def stream_request(
    pool: ConnectionPool, url: str, model: str, prompt: list[int], max_tokens: int,
    on_chunk: Callable[[Trace], None] | None = None,
) -> Trace:
    """Send one streamed completion and time every chunk.

    It goes over the gateway's own upstream client (`llmflow.gateway.http1`), so the backend is
    timed as the gateway sees it, and the client spends little CPU per chunk. `on_chunk` is
    called with the trace after each event is recorded.

    Raises:
        RuntimeError: the backend refused it or streamed no tokens.
    """
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
        "ignore_eos": True, "temperature": 0.0,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    trace = Trace(len(prompt), time.perf_counter())
    response = await pool.request(f"{url}/v1/completions", _HEAD, json.dumps(body).encode())
    try:
        if response.status != 200:
            detail = (await response.read_all(4096)).decode("utf-8", "replace")
            raise RuntimeError(f"{url} answered {response.status}: {detail[:300]}")
        buffer = b""
        async for piece in response.iter_body():
            now = time.perf_counter()
            buffer += piece
            while (end := buffer.find(b"\n\n")) >= 0:
                event, buffer = buffer[:end], buffer[end + 2:]
                if event.startswith(b"data: {"):
                    _record(trace, json.loads(event[6:]), now)
                    if on_chunk is not None:
                        on_chunk(trace)
    finally:
        response.release()
    if not trace.chunks:
        raise RuntimeError("the backend streamed no tokens")
    return trace


def _record(trace: Trace, chunk: dict[str, Any], now: float) -> None:
    usage = chunk.get("usage") or {}
    choices = chunk.get("choices")
    if choices and isinstance(usage.get("completion_tokens"), int):
        trace.chunks.append((now, usage["completion_tokens"]))
    elif choices and any(c.get("text") or (c.get("delta") or {}).get("content") for c in choices):
        # no continuous usage: count a token per chunk that carries text
        trace.chunks.append((now, (trace.chunks[-1][1] if trace.chunks else 0) + 1))
    if isinstance(usage.get("prompt_tokens"), int):
        trace.prompt_tokens = usage["prompt_tokens"]


def decode_sample(traces: list[Trace], concurrency: int) -> DecodeSample | None:
    """The step time while every trace was decoding, or None if that window was too short.

    The window runs from the last first token to the first last token, less `_WINDOW_EDGE`
    tokens at each end; each trace's step time is its time per token inside the window.
    """
    start = max(t.chunks[0][0] for t in traces)
    stop = min(t.chunks[-1][0] for t in traces)
    per_token, ctx = [], 0.0
    for t in traces:
        inside = [c for c in t.chunks if start <= c[0] <= stop]
        inside = inside[_WINDOW_EDGE:len(inside) - _WINDOW_EDGE]
        if len(inside) < 2 or inside[-1][1] - inside[0][1] < _MIN_WINDOW:
            return None
        per_token.append((inside[-1][0] - inside[0][0]) / (inside[-1][1] - inside[0][1]))
        ctx += t.prompt_tokens + (inside[0][1] + inside[-1][1]) / 2
    return DecodeSample(concurrency, round(statistics.mean(t.prompt_tokens for t in traces)),
                        statistics.mean(per_token), ctx)


async def _server_facts(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    models = (await client.get(f"{url}/v1/models")).raise_for_status().json()["data"]
    facts: dict[str, Any] = {"models": [m["id"] for m in models]}
    if models and isinstance(models[0].get("max_model_len"), int):
        facts["max_model_len"] = models[0]["max_model_len"]
    response = await client.get(f"{url}/metrics")
    for line in response.text.splitlines() if response.status_code == 200 else ():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(_LABEL.findall(line))
            for key in ("block_size", "num_gpu_blocks"):
                if labels.get(key, "").isdigit():
                    facts[key] = int(labels[key])
    return facts


def _fit_to_limits(cal: Calibration, facts: dict[str, Any]) -> None:
    """Drop probes the backend cannot run without refusing or preempting them.

    Each probe is checked on its own, in whole KV blocks (vLLM allocates per block and never
    hands out block 0), so a small cache still gets long contexts at small batch sizes and
    large batches at short ones: the decode sweep keeps every (context, batch) pair that fits.
    """
    longest = facts.get("max_model_len", 1 << 30) - cal.decode_tokens
    size = facts.get("block_size", 1)
    usable = (facts["num_gpu_blocks"] - 1) * _KV_HEADROOM if "num_gpu_blocks" in facts \
        else float("inf")

    def fits(*tokens: int) -> bool:
        return bool(sum(-(-t // size) for t in tokens) <= usable)

    cal.prompt_lengths = tuple(n for n in cal.prompt_lengths if n < longest and fits(n + 1))
    batch = (_MIXED_CONTEXT + _MIXED_TOKENS,) * cal.mixed_decodes
    cal.mixed_prompts = tuple(
        n for n in cal.mixed_prompts if n < longest and fits(n + 1, *batch))
    cal.batches = tuple((c, b) for c, b in cal.decode_batches()
                        if c <= longest and fits(*(c + cal.decode_tokens,) * b))


class _Runner:
    def __init__(self, cal: Calibration, pool: ConnectionPool, model: str,
                 tick: Callable[[int], None]):
        self.cal, self.pool, self.model, self.tick = cal, pool, model, tick
        self.rng = random.Random(cal.seed)

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(*_TOKEN_IDS) for _ in range(n)]

    async def one(self, prompt_tokens: int, max_tokens: int,
                  on_chunk: Callable[[Trace], None] | None = None) -> Trace:
        trace = await stream_request(self.pool, self.cal.url, self.model,
                                     self.prompt(prompt_tokens), max_tokens, on_chunk)
        self.tick(1)
        return trace

    async def prefill(self) -> list[PrefillSample]:
        out = []
        for _ in range(self.cal.repeats):  # interleaved, so drifting load hits every length
            for n in self.cal.prompt_lengths:
                out.append(PrefillSample(n, (await self.one(n, 1)).ttft_s))
                await asyncio.sleep(_SETTLE_S)
        return out

    async def decode(self) -> list[DecodeSample]:
        out = []
        for _ in range(self.cal.decode_repeats):
            for ctx, b in self.cal.decode_batches():
                traces = await asyncio.gather(
                    *(self.one(ctx, self.cal.decode_tokens) for _ in range(b)))
                sample = decode_sample(list(traces), b)
                if sample is not None:
                    out.append(sample)
                await asyncio.sleep(_SETTLE_S)
        return out

    async def mixed(self) -> list[MixedSample]:
        out = []
        for _ in range(self.cal.repeats):
            for n in self.cal.mixed_prompts:
                decoding = _Decoding(self.cal.mixed_decodes)
                batch = [asyncio.create_task(
                    self.one(_MIXED_CONTEXT, _MIXED_TOKENS, decoding.saw))
                    for _ in range(self.cal.mixed_decodes)]
                await decoding.wait(batch)
                joined = await self.one(n, 1)
                sample = mixed_sample(list(await asyncio.gather(*batch)), joined)
                if sample is not None:
                    out.append(sample)
                await asyncio.sleep(_SETTLE_S)
        return out


class _Decoding:
    """Set once each of `size` streams has `_JOIN_AFTER_CHUNKS` chunks: the batch decodes."""

    def __init__(self, size: int):
        self.waiting, self.event = size, asyncio.Event()

    def saw(self, trace: Trace) -> None:
        if len(trace.chunks) == _JOIN_AFTER_CHUNKS:
            self.waiting -= 1
            if self.waiting == 0:
                self.event.set()

    async def wait(self, batch: list[asyncio.Task[Trace]]) -> None:
        """Until the batch decodes, or one of its streams ends first (its error is raised, and
        the batch's other streams are cancelled: none is left reading its backend)."""
        ready = asyncio.ensure_future(self.event.wait())
        try:
            await asyncio.wait([ready, *batch], return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
        for task in batch:
            if task.done() and (error := task.exception()) is not None:
                for other in batch:
                    other.cancel()
                raise error


def mixed_sample(batch: list[Trace], joined: Trace) -> MixedSample | None:
    """The step in which `joined`'s prompt was computed among `batch`'s decodes, or None.

    For each decoder: the time it took for `_JOIN_SPAN` tokens from the last one before the
    prompt was sent (a span that holds the prompt's step), less as many of its own steps
    before that (the median gap of up to 16); what is left is the prompt's share of its step.
    Spans make single late chunks harmless. The median over the batch is kept.
    """
    steps, ctx = [], 0.0
    for t in batch:
        times, tokens = [c[0] for c in t.chunks], [c[1] for c in t.chunks]
        i0 = max((i for i, c in enumerate(times) if c < joined.sent), default=-1)
        i1 = next((i for i in range(i0 + 1, len(tokens))
                   if tokens[i] - tokens[max(i0, 0)] >= _JOIN_SPAN), None)
        if i0 < 4 or i1 is None or i1 == len(tokens) - 1:
            continue
        lo = max(1, i0 - 16)
        before = [(times[i] - times[i - 1]) / (tokens[i] - tokens[i - 1])
                  for i in range(lo, i0 + 1)]
        base = statistics.median(before)
        span = tokens[i1] - tokens[i0]
        steps.append(base + (times[i1] - times[i0]) - span * base)
        ctx += t.prompt_tokens + tokens[i0]
    if len(steps) * 2 < len(batch):  # most decoders had not started or had already finished
        return None
    return MixedSample(len(batch), ctx * len(batch) / len(steps), joined.prompt_tokens,
                       statistics.median(steps))


async def calibrate(cal: Calibration, tick: Callable[[int], None] = lambda n: None) -> Profile:
    """Measure the backend and fit a profile.

    Args:
        cal: what to measure.
        tick: called with the number of requests finished (progress).

    Returns:
        The fitted profile with its raw measurements.

    Raises:
        httpx.HTTPError, OSError: the backend could not be reached.
        RuntimeError: the backend refused a probe.
        ValueError: the measurements could not be fitted.
    """
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as client:
        facts = await _server_facts(client, cal.url)
    model = cal.model or facts["models"][0]
    _fit_to_limits(cal, facts)
    pool = ConnectionPool(connect_timeout_s=10.0)
    try:
        runner = _Runner(cal, pool, model, tick)
        await runner.one(8, 4)  # warm-up: first-request costs are not the engine's
        prefill = await runner.prefill()
        decode = await runner.decode()
        mixed = await runner.mixed()
    finally:
        pool.close()
    step, frontend, stats = fit_step_model(prefill, decode, mixed)
    engine: dict[str, int] = {
        k: facts[k] for k in ("block_size", "num_gpu_blocks", "max_model_len") if k in facts}
    engine.update(cal.engine)
    return Profile(
        backend=cal.url, model=model,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        step_s=step, frontend_s=frontend, engine=engine, fit=stats,
        measurements={
            "prefill": [{"prompt_tokens": p.prompt_tokens, "ttft_s": round(p.ttft_s, 6)}
                        for p in prefill],
            "decode": [{"concurrency": d.concurrency, "prompt_tokens": d.prompt_tokens,
                        "itl_s": round(d.itl_s, 6), "decode_ctx": round(d.decode_ctx, 1)}
                       for d in decode],
            "mixed": [{"decodes": m.decodes, "decode_ctx": round(m.decode_ctx, 1),
                       "prompt_tokens": m.prompt_tokens, "step_s": round(m.step_s, 6)}
                      for m in mixed],
        },
    )
