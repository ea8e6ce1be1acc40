#!/usr/bin/env bash
# requirements/verl-gpu.lock, the pinned and hashed install of .venv-verl (./scripts/setup-verl.sh --gpu), from
# requirements/verl-gpu.txt. Runs on any box (resolution needs no GPU): uv resolves for the GPU box's platform, Linux
# x86_64 (manylinux_2_28, what torch 2.11's and vLLM 0.24's wheels are tagged) and Python 3.11 (the interpreter
# setup.sh builds .venv with; docs/decisions.md "Install: the GPU lock"). uv comes from a scratch venv.
#   ./scripts/lock-verl-gpu.sh [OUT]           regenerate (OUT defaults to requirements/verl-gpu.lock); ~10 s
#   ./scripts/lock-verl-gpu.sh --verify OUT    resolve verl-gpu.txt with the committed lock as constraints into OUT:
#                                              the lock's pins and hashes again unless the requirements changed or a
#                                              locked release left the registry (tests/unit/test_gpu_lock.py compares)
#   ./scripts/lock-verl-gpu.sh --check         list what the registry holds today that is newer than the lock (exit 1
#                                              if anything); opt-in, never in the test suite: its answer changes daily
set -euo pipefail
cd "$(dirname "$0")/.."
mode=lock
case "${1:-}" in
  --verify) mode=verify; shift; out=${1:?--verify needs an output file} ;;
  --check) mode=check; out=$(mktemp --suffix=.lock); trap 'rm -f "$out"' EXIT ;;
  *) out=${1:-requirements/verl-gpu.lock} ;;
esac
# Only releases published before this instant. A cut-off narrows a fresh resolution, but it does not make one
# reproducible on this project's registry, which does not keep a release's view fixed by date (a release may appear
# or vanish under an old date): the committed lock is the fixed point, and --verify checks against it.
# Move it forward, rerun this script and commit the lock to take newer releases.
EXCLUDE_NEWER=2026-11-27T00:00:00Z
uv=${UV:-$(command -v uv || true)}
if [[ -z "$uv" ]]; then
  [[ -x /tmp/arpo-uv/bin/uv ]] || { python3 -m venv /tmp/arpo-uv && /tmp/arpo-uv/bin/pip install -q 'uv==0.13.9'; }
  uv=/tmp/arpo-uv/bin/uv
fi
compile=("$uv" pip compile requirements/verl-gpu.txt --python-platform x86_64-manylinux_2_28 --python-version 3.11
         --generate-hashes --no-progress --quiet --custom-compile-command ./scripts/lock-verl-gpu.sh -o "$out")
case $mode in
  lock) "${compile[@]}" --exclude-newer "$EXCLUDE_NEWER" ;;
  verify) "${compile[@]}" --constraint requirements/verl-gpu.lock ;;
  check)
    "${compile[@]}"
    newer=$(diff <(grep -oE '^[A-Za-z0-9][A-Za-z0-9._-]*==[^ \\;]+' requirements/verl-gpu.lock | sort) \
                 <(grep -oE '^[A-Za-z0-9][A-Za-z0-9._-]*==[^ \\;]+' "$out" | sort) | sed -n 's/^> /  /p' || true)
    if [[ -z "$newer" ]]; then
      echo "requirements/verl-gpu.lock: nothing newer on the registry today"
    else
      echo "newer than requirements/verl-gpu.lock on the registry today (take them: move EXCLUDE_NEWER in" \
           "scripts/lock-verl-gpu.sh forward, rerun it, test on a GPU box, commit the lock):"
      echo "$newer"
      exit 1
    fi ;;
esac
