#!/usr/bin/env bash
# Regenerates requirements/verl-gpu.lock, the pinned and hashed install of .venv-verl (./scripts/setup-verl.sh
# --gpu), from requirements/verl-gpu.txt. Runs on any box (resolution needs no GPU): uv resolves for the GPU box's
# platform, Linux x86_64 (manylinux_2_28, what torch 2.11's and vLLM 0.24's wheels are tagged) and Python 3.11 (the
# interpreter setup.sh builds .venv with; docs/decisions.md "Install: the GPU lock"). uv comes from a scratch venv.
#   ./scripts/lock-verl-gpu.sh [OUT]     OUT defaults to requirements/verl-gpu.lock; ~10 s with network to PyPI
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-requirements/verl-gpu.lock}
# Only releases published before this instant: the same inputs give the same lock next month (the slow test
# re-resolves and compares). Move it forward, rerun this script and commit the lock to take newer releases.
EXCLUDE_NEWER=2026-11-27T00:00:00Z
uv=${UV:-$(command -v uv || true)}
if [[ -z "$uv" ]]; then
  [[ -x /tmp/arpo-uv/bin/uv ]] || { python3 -m venv /tmp/arpo-uv && /tmp/arpo-uv/bin/pip install -q 'uv==0.13.9'; }
  uv=/tmp/arpo-uv/bin/uv
fi
"$uv" pip compile requirements/verl-gpu.txt --python-platform x86_64-manylinux_2_28 --python-version 3.11 \
  --exclude-newer "$EXCLUDE_NEWER" --generate-hashes --no-progress --quiet \
  --custom-compile-command ./scripts/lock-verl-gpu.sh -o "$out"
