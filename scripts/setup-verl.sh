#!/usr/bin/env bash
# verl 0.9.1 environments, from the repo's own files (idempotent: pip runs only when a requirements file changed).
#   ./scripts/setup-verl.sh --test   .venv-verl-test: verl without vLLM on CPU, for the contract tests (tests/verl)
#   ./scripts/setup-verl.sh --gpu    .venv-verl: verl[vllm] for the RL stage (rl.engine: verl) and vLLM serving
# This project is installed into it with --no-deps (its stages import only what requirements/verl-project.txt
# lists); that also registers the `verl.plugins` entry point, so `import verl` loads our plugin in every process.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:---gpu}
case "$mode" in
  --test) venv=.venv-verl-test; req=requirements/verl-test.txt ;;
  --gpu)  venv=.venv-verl;      req=requirements/verl-gpu.txt ;;
  *) echo "usage: $0 [--test|--gpu]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
stamp="$venv/.arpo-installed-$(cat "$req" requirements/verl-project.txt pyproject.toml | sha256sum | cut -c1-16)"
if [[ -f "$stamp" ]]; then
  exit 0
fi
start=$(date +%s)
[[ -x "$venv/bin/python" ]] || "$PY" -m venv "$venv"
echo "[setup-verl] $venv: pip install -r $req (first time: a few minutes)"
"$venv/bin/pip" install --disable-pip-version-check -q -r "$req"
# verl's GPU image may be Python 3.12 while pyproject says <3.12 (the main venv's LLaMA-Factory pins): the stages
# that run here do not depend on that bound.
"$venv/bin/pip" install --disable-pip-version-check -q --no-deps --no-warn-conflicts --ignore-requires-python -e .
if ! out=$("$venv/bin/python" -c "import verl, stages.rl.verl.settings; assert verl.__version__ == '0.9.1'" 2>&1); then
  echo "$out" >&2
  exit 1
fi
rm -f "$venv"/.arpo-installed-* && touch "$stamp"
echo "[setup-verl] $venv ready in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1)"
