#!/usr/bin/env bash
# A GPU box (README: GPU runbook): the main venv plus .venv-verl (verl[vllm] 0.9.1 + this project --no-deps),
# which runs the RL stage (rl.engine: verl) and serves the merged model with its vLLM. Then the pre-flight check
# the RL stage also runs: a fresh `import verl` must see every registration of our plugin.
set -euo pipefail
cd "$(dirname "$0")/.."
ARPO_SKIP_VLLM=1 ./scripts/setup.sh   # no .venv-vllm: .venv-verl's vLLM serves (two environments, not three)
./scripts/setup-verl.sh --gpu
.venv-verl/bin/python -m stages.rl.verl.preflight
cat <<'MSG'
[setup-gpu] ready. Run a paper profile with:
  .venv/bin/arpo run -p arpo-qwen2.5-7b-reasoning
MSG
