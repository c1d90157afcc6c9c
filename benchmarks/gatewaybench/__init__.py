"""llmflow's gateway benchmark, in modules; run it with `python -m benchmarks.gateway_bench`.

`backend` is the fake vLLM, `clients` the raw-socket clients, `procs` the processes under test
and their /proc readings, `phases` the measurements, `report` the tables and charts, `cli` the
command that runs them all.
"""
