"""`llmflow sim tune`: search a gated policy's knobs with optuna over simulated runs.

`space` holds the knob table, `goals` the metrics, objectives and constraints, `search` the
worker processes around one optuna study, `outputs` what is written, `run` one whole run and
`cli` the command.
"""
