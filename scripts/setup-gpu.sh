#!/usr/bin/env bash
# A GPU box (README: GPU runbook): the main venv plus .venv-verl (verl[vllm] 0.9.1 + this project --no-deps),
# which runs the RL stage (rl.engine: verl) and serves the merged model with its vLLM. Then the pre-flight check
# the RL stage also runs: a fresh `import verl` must see every registration of our plugin.
# Both environments install CUDA 13 wheels: the driver is checked first (scripts/check-driver.sh, driver >= 580).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/check-driver.sh
ARPO_SKIP_VLLM=1 ./scripts/setup.sh   # no .venv-vllm: .venv-verl's vLLM serves (two environments, not three)
# DeepSpeed in .venv: the paper profiles' SFT runs LLaMA-Factory with ZeRO-3 offload (sft.deepspeed:
# configs/deepspeed/ds_z3_offload.json), and LLaMA-Factory refuses a deepspeed config without the package. PyPI has
# only its sdist (a pure-Python build; its ops, the CPU Adam of the offload included, compile at first use).
DEEPSPEED=0.19.8
if ! .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('deepspeed') != '$DEEPSPEED')" \
    2>/dev/null; then
  echo "[setup-gpu] .venv: pip install deepspeed==$DEEPSPEED"
  .venv/bin/pip install --disable-pip-version-check -q "deepspeed==$DEEPSPEED"
fi
./scripts/setup-verl.sh --gpu
.venv-verl/bin/python -m stages.rl.verl.preflight
cat <<'MSG'
[setup-gpu] ready. Run a paper profile with:
  .venv/bin/arpo run -p arpo-qwen2.5-7b-reasoning
MSG
