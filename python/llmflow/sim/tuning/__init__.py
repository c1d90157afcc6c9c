"""`llmflow sim tune`: search a gated policy's knobs with optuna over simulated runs.

`space` holds the knob table, `goals` the metrics, objectives and constraints, `plan` the
command's options, the plan workers share and the evaluation of one config, `search` the study
and its held-out check, `workers` the processes that run its trials, `storage` where the study
lives, `outputs` and `pareto` what is written, `run` one whole run and `cli` the command.
"""
