"""The simulator: vLLM backends modelled in SimPy, driven by the same Rust core as the gateway.

See docs/simulator.md. Entry points: `llmflow.sim.runner.run_scenario`, the `llmflow sim`
commands (`llmflow.sim.cli`) and the simulated vLLM server (`llmflow.sim.server.create_app`).
"""
