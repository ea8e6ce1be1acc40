#!/usr/bin/env bash
# The test command: install if needed, then the whole default suite (unit + integration on the tiny model).
# Extra arguments go to pytest (e.g. -m "not slow", -k rollout).
set -euo pipefail
cd "$(dirname "$0")/.."
ARPO_WITH_BROWSER=1 ./scripts/setup.sh
# verl 0.9.1 contract tests run in their own environment (tests/integration/test_verl_contract.py)
./scripts/setup-verl.sh --test
# lint first (ruff, pinned in the test extra; config in pyproject.toml): well under a second
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -m "not gpu" "$@"
