#!/usr/bin/env bash
# The main job: install if needed, start the local Prefect UI, run the whole tiny chain on CPU, offline.
# Extra arguments go to `arpo run` (e.g. --refresh rl, -o rl.rollout.n=8).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/arpo server start
.venv/bin/arpo run "$@"
