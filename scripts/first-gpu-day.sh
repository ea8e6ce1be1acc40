#!/usr/bin/env bash
# The first GPU day as one command (docs/gpu-runbook.md "The first GPU day"): the verl GPU test, which vLLM served,
# one step of the 14B profile with its time split, the released-checkpoint parity check on GAIA and HLE, then one
# report (first-gpu-day/first-gpu-day.md) that says which lever comes first. --dry-run checks every step on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python scripts/first_gpu_day.py "$@"
