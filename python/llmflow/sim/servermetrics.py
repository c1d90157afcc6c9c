"""Prometheus text for the simulated vLLM's `/metrics`, with vLLM's metric names and labels.

Gauges `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`
(0..1; also under the older name `vllm:gpu_cache_usage_perc`), `vllm:cache_config_info`
(`num_gpu_blocks`, `block_size` labels); counters `vllm:num_preemptions_total`,
`vllm:prompt_tokens_total`, `vllm:generation_tokens_total`, `vllm:prefix_cache_queries_total`,
`vllm:prefix_cache_hits_total` (tokens), `vllm:request_success_total`
(`finished_reason`); histograms `vllm:time_to_first_token_seconds`,
`vllm:inter_token_latency_seconds`, `vllm:e2e_request_latency_seconds`,
`vllm:request_queue_time_seconds`. Labels `engine="0"` and `model_name`.

One llmflow-only counter, `llmflow_sim_prefill_computed_tokens_total`: the prompt tokens the
simulated GPU actually prefilled (recomputes after preemption counted again, prefix-cache hits
and KV pulled from a P/D prefill server not at all), which `vllm:prompt_tokens_total` (every
prompt's length once) cannot tell apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmflow.sim.driver import Histogram, RealtimeEngine

__all__ = ["render_metrics"]


def _family(lines: list[str], name: str, kind: str, doc: str) -> None:
    lines.append(f"# HELP {name} {doc}")
    lines.append(f"# TYPE {name} {kind}")


def _hist(lines: list[str], name: str, doc: str, h: Histogram, labels: str) -> None:
    _family(lines, name, "histogram", doc)
    for le, n in h.cumulative():
        lines.append(f'{name}_bucket{{{labels},le="{le}"}} {n}')
    lines.append(f"{name}_sum{{{labels}}} {h.sum}")
    lines.append(f"{name}_count{{{labels}}} {float(h.count)}")


def render_metrics(engine: RealtimeEngine | None, model: str) -> str:
    """The exposition text; an engine not yet started reports nothing but its config."""
    labels = f'engine="0",model_name="{model}"'
    lines: list[str] = []
    if engine is None:
        return ""
    core = engine.core
    for name, kind, doc, value in (
        ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
         core.num_running),
        ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
         core.num_waiting),
        ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
         core.kv_usage),
        ("vllm:gpu_cache_usage_perc", "gauge", "GPU KV-cache usage (pre-V1 name).", core.kv_usage),
        ("vllm:num_preemptions_total", "counter", "Cumulative number of preemptions.",
         core.num_preemptions),
        ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
         core.prompt_tokens_total),
        ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
         core.generation_tokens_total),
        ("vllm:prefix_cache_queries_total", "counter",
         "Prefix cache queries, in terms of number of queried tokens.", core.prefix_query_tokens),
        ("vllm:prefix_cache_hits_total", "counter",
         "Prefix cache hits, in terms of number of cached tokens.", core.prefix_hit_tokens),
        ("llmflow_sim_prefill_computed_tokens_total", "counter",
         "Prompt tokens the engine's steps prefilled (recomputes in; cache hits, pulled KV out).",
         engine.prefill_tokens),
    ):
        _family(lines, name, kind, doc)
        lines.append(f"{name}{{{labels}}} {float(value)}")
    _family(lines, "vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig")
    lines.append(
        f'vllm:cache_config_info{{block_size="{core.block_size}",engine="0",'
        f'num_gpu_blocks="{core.num_blocks}"}} 1.0')
    _family(lines, "vllm:request_success_total", "counter",
            "Count of successfully processed requests.")
    for reason in ("stop", "length", "abort"):
        n = engine.requests_success.get(reason, 0)
        lines.append(f'vllm:request_success_total{{{labels},finished_reason="{reason}"}} '
                     f"{float(n)}")
    _hist(lines, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
          engine.ttft, labels)
    _hist(lines, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
          engine.itl, labels)
    _hist(lines, "vllm:e2e_request_latency_seconds",
          "Histogram of e2e request latency in seconds.", engine.e2e, labels)
    _hist(lines, "vllm:request_queue_time_seconds",
          "Histogram of time spent in WAITING phase for request.", engine.queue_time, labels)
    return "\n".join(lines) + "\n"
