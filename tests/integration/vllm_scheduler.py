"""Run vLLM V1's own `Scheduler` over a workload, with no model: the reference step log.

Runs inside the vLLM venv (`scripts/vllm_env.sh`), not the project's environment::

    $VENV/bin/python tests/integration/vllm_scheduler.py MODEL_DIR CASE.json > LOG.json

CASE.json: `{"engine": {num_gpu_blocks, block_size, max_num_seqs, max_num_batched_tokens,
max_model_len, watermark}, "requests": [[arrival_step, prompt_tokens, output_tokens], ...]}`.
Every request has a prompt of its own (distinct token ids, so no cross-request prefix
hits) and `ignore_eos`. Each step the scheduler plans, every scheduled request whose tokens
reach its end samples one token, and `update_from_output` applies it, as the engine core does
with a model. MODEL_DIR is any model vLLM can read a config from (the tiny test model);
nothing is loaded. The output has, per step, `[running, waiting, preempted, scheduled tokens]`
after the step (the counts vLLM's scheduler stats report).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager


def scheduler(model: str, e: dict[str, Any]) -> Scheduler:
    """vLLM's V1 scheduler with `e`'s limits over a KV cache of `num_gpu_blocks` blocks."""
    bs, blocks = e["block_size"], e["num_gpu_blocks"]
    sc = SchedulerConfig(max_num_seqs=e["max_num_seqs"],
                         max_num_batched_tokens=e["max_num_batched_tokens"],
                         max_model_len=e["max_model_len"], enable_chunked_prefill=True,
                         is_encoder_decoder=False, watermark=e.get("watermark", 0.0))
    mc = ModelConfig(model=model, dtype="float32", seed=0, max_model_len=e["max_model_len"])
    cc = CacheConfig(block_size=bs, enable_prefix_caching=True)
    vc = VllmConfig(scheduler_config=sc, model_config=mc, cache_config=cc)
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    cc.num_gpu_blocks = blocks
    return Scheduler(vllm_config=vc, kv_cache_config=kv, log_stats=True,
                     structured_output_manager=StructuredOutputManager(vc), block_size=bs)


def run(model: str, case: dict[str, Any]) -> list[list[int]]:
    """Step the scheduler until every request has finished; the per-step log."""
    s = scheduler(model, case["engine"])
    init_none_hash(sha256)
    hasher = get_request_block_hasher(case["engine"]["block_size"], sha256)
    reqs = sorted(enumerate(case["requests"]), key=lambda x: x[1][0])
    log: list[list[int]] = []
    i = done = 0
    while done < len(reqs):
        while i < len(reqs) and reqs[i][1][0] <= len(log):
            k, (_, prompt, out) = reqs[i]
            i += 1
            ids = [5 + (k * 7919 + j) % 4000 for j in range(prompt)]
            s.add_request(Request(request_id=str(k), prompt_token_ids=ids,
                                  sampling_params=SamplingParams(ignore_eos=True, max_tokens=out),
                                  pooling_params=None, block_hasher=hasher))
        plan = s.schedule()
        rids = list(plan.num_scheduled_tokens)
        sampled = [[17] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else []
                   for r in rids]
        outputs = s.update_from_output(plan, ModelRunnerOutput(
            req_ids=rids, req_id_to_index={r: j for j, r in enumerate(rids)},
            sampled_token_ids=sampled))
        done += sum(o.finish_reason is not None for v in outputs.values() for o in v.outputs)
        log.append([len(s.running), len(s.waiting), len(plan.preempted_req_ids or ()),
                    sum(plan.num_scheduled_tokens.values())])
    return log


if __name__ == "__main__":
    with open(sys.argv[2], encoding="utf-8") as f:
        json.dump({"steps": run(sys.argv[1], json.load(f))}, sys.stdout)
