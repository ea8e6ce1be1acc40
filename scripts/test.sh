#!/usr/bin/env bash
# The test command: install if needed, then the whole default suite (unit + integration on the tiny model) on two
# pytest-xdist workers, and where its time went (each set-up step, the 25 slowest tests).
# Extra arguments go to pytest (e.g. -m "not slow", -k rollout, -n 0 for one process).
set -euo pipefail
cd "$(dirname "$0")/.."
timed() {  # timed <label> <command...>: run it and say how long it took, whether it was a no-op or a real install
  local start=$SECONDS
  "${@:2}"
  echo "[setup] $1: $((SECONDS - start)) s"
}
timed "main + vLLM environments (scripts/setup.sh)" env ARPO_WITH_BROWSER=1 ./scripts/setup.sh
# verl 0.9.1 contract tests run in their own environment (tests/integration/test_verl_contract.py); the suite's verl
# run (tests/integration/test_rehearse_verl_e2e.py) in that environment layered over .venv-vllm (no install)
timed "verl test environment (setup-verl.sh --test)" ./scripts/setup-verl.sh --test
timed "verl CPU environment (setup-verl.sh --cpu)" ./scripts/setup-verl.sh --cpu
# The tiny-model tests need disk: the session's shared tiny-model outputs (~1 GB), and the modules running on the
# two workers write up to ~3 GB each (models, checkpoints, merged copies; a module's folders go when it ends,
# tests/conftest.py module_scratch). Say so up front, not as Errno 28; the summary prints the lowest free space seen.
tmp_dir=${TMPDIR:-/tmp}
free_kib=$(df -Pk "$tmp_dir" | awk 'NR==2 {print $4}')
echo "[setup] disk: $((free_kib / 1024 / 1024)) GiB free under $tmp_dir after the set-up"
if (( free_kib < 8 * 1024 * 1024 )); then
  echo "[test] WARNING: only $((free_kib / 1024)) MiB free under $tmp_dir; the tiny-model tests need ~8 GB." \
       "Free some space or point TMPDIR at a larger disk." >&2
fi
# lint first (ruff, pinned in the test extra; config in pyproject.toml): well under a second
.venv/bin/ruff check .
# every generated docs block (flows/generated_docs.py: the config page, key coverage, deployments, ...) is current:
# a few seconds; `python -m flows.cli docs --write` rewrites the stale ones
.venv/bin/python -m flows.cli docs --check
# Two workers: most tests run one single-threaded process at a time (tiny model, one torch thread), so two lanes
# use the two cores; tests/conftest.py orders and groups the work (longest modules first, one vLLM server).
# `extended` (tests/integration/test_faults.py, ~4 min) is left out of the default suite: ./scripts/test.sh -m extended;
# so is `network` (a test that reads the network beyond the package registry; docs/testing.md lists them)
exec .venv/bin/python -m pytest -m "not gpu and not extended and not network" -n 2 --durations=25 "$@"
