"""The `verl` RL engine: verl on Ray (its version: stages/core/engine_spec.py) trains the policy, our algorithm runs
inside it (docs/rl.md).

Modules without a verl import (usable from the project venv): `settings` (what the plugin reads in every Ray
process), `tree` (our TreeRollout over verl's LLM-server generate API), `mapping` (our config -> verl hydra
overrides), `reward` (verl's custom reward function), `parity` (prompt token ids across environments),
`resources` (the pre-flight of Ray CPUs, vLLM's memory share and the attention), `advantage` (our estimator over
verl's rows, whole trees only), `monitor` (verl's metrics in our names, followed live), `launch` (the stage entry
point). Modules that import verl (loaded in verl's environment only): `plugin` (registrations, named by the
`verl.plugins` entry point and VERL_USE_EXTERNAL_MODULES), `agent_loop` (the tree agent loop and the worker/manager
override), `trainer_mode` (`arpo_sync`: verl's sync mode with our advantage step and metrics), `topk_server`
(exact top-k entropy through a vLLM server replica).
"""
