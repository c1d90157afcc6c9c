"""Gateway benchmark: llmflow against vllm-router and a direct connection, in one run.

What the gateway's hot path costs, measured beside its peer in the same run (issues 9 and 23).
Four kinds of process on loopback:

- a fake vLLM (`--backend PORT`, `gatewaybench/backend.py`): every request gets its first token
  at 20 ms, then 100 tokens 10 ms apart (so 256 streams offer 25.6k chunks/s);
- `llmflow serve` with admission, the fair queue and the KV ledger active (default policy,
  except a slot cap and queue of 5,120 so that nothing queues, `sse_flush_interval: 0`, and
  the TTFT SLA at one hour: see `gatewaybench/procs.py:llmflow_config`), the native front
  door on its port;
- `vllm-router==0.1.17` from PyPI, in a venv of its own under
  `~/.cache/llmflow/vllm-router-0.1.17` (installed on first use), started as
  `vllm-router --host 127.0.0.1 --port P --worker-urls http://127.0.0.1:U --policy round_robin
  --prometheus-port P2 --worker-startup-check-interval 1`;
- this driver: raw-socket keep-alive clients (closed loop, one connection per stream).

Pinning: the fake vLLM and the clients on CPU 0, the gateway under test on CPU 1. Every run
also records what the machine's other work took from each CPU meanwhile ("others' load").

Phases:
1. Concurrency levels (1, 16, 64, 128, 256 streams), in two modes (`--mode`): *staggered*, the
   streams started evenly over one request period, and *burst*, every connection opened first,
   warmed by one unmeasured burst, then every stream's request written in one loop and the
   window opened there, each stream going on closed loop after it (not at 1 stream: that is
   the staggered run). Direct, the llmflow arms and the router interleaved, 3 repeats; per mode
   and level the medians of TTFT p50/p99 (burst: also the burst's own requests'), inter-chunk
   gap p99 (each "added" = arm minus direct of the same repeat and mode), chunks/s, the
   gateway's CPU per chunk (utime+stime of every thread over the window / chunks the clients
   counted) and its CPU utilisation.
2. Peak chunk rate, for each llmflow arm and the router, staggered: the most streams at which
   the gateway adds <= 5 ms to the clients' inter-chunk gap p99 (over direct at the same
   streams, run just before it). The levels bracket it; past the top level streams double,
   then bisect. Where direct itself falls behind its schedule the harness (CPU 0) is the limit
   and it says so.
3. Memory per idle open stream: 1,000 and 5,000 streams that got their first token and then
   hold; (VmRSS open - VmRSS before) / streams, each on a fresh gateway process.
4. Relay workers (`--llmflow-workers 1,2`): `llmflow serve --workers N` at the top level, pinned
   to CPU 1 for N=1 and on both CPUs for N>1; skipped with a note when `serve` lacks the flag.

The output opens with issue 23's goals per llmflow arm (added TTFT at 1 stream, at 256
staggered and in the 256 burst; CPU per chunk against the router's; memory per idle stream).

Usage:
    python -m benchmarks.gateway_bench            # everything, ~16 min; JSON in
                                                  # benchmarks/results/gateway.json, charts in
                                                  # docs/img/, markdown tables on stdout
    python -m benchmarks.gateway_bench --quick    # development run, ~2.5 min (bursts at the
                                                  # top level only), outputs in /tmp
    python -m benchmarks.gateway_bench --burst-only
                                                  # the 256-stream burst only, llmflow and
                                                  # the router, 3 repeats, < 3 min,
                                                  # outputs in /tmp
    options: --levels 1,64,256 --repeats N --window S --memory 1000,5000
             --mode staggered,burst
             --llmflow-workers 1,2 (or '') --no-router --no-peak --no-memory
             --baseline DIR (another checkout's python/, its extension built: the arm
             llmflow-base, beside this checkout's llmflow in the same run)
             --nice -10 (the arms take CPU from other work first; opt-in)
             --json PATH --charts DIR
    python -m benchmarks.gateway_bench --render benchmarks/results/gateway.json
                                                  # tables and charts again, from a result

Any refused request (non-200 or broken stream) through a gateway makes the run invalid: the
script says so and exits 1.
"""

from __future__ import annotations

from benchmarks.gatewaybench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
