#!/usr/bin/env bash
# The NVIDIA driver check of a GPU box (./scripts/setup-gpu.sh, ./scripts/setup-verl.sh --gpu), before any install:
# the wheels both environments install are CUDA 13 builds (requirements/verl-gpu.lock: torch 2.11.0 requires
# cuda-toolkit 13.0.2, vLLM 0.24.0 nvidia-cutlass-dsl[cu13]), and CUDA 13.x runs on driver branch 580 or newer.
# An older driver installs fine and fails at the first CUDA call ("The NVIDIA driver on your system is too old").
#   ARPO_SKIP_DRIVER_CHECK=1   skip it (building the environments on a machine without the GPU, e.g. an image)
set -euo pipefail
MIN_DRIVER=580
[[ "${ARPO_SKIP_DRIVER_CHECK:-}" == 1 ]] && exit 0
fix="install NVIDIA driver $MIN_DRIVER or newer (e.g. apt-get install nvidia-driver-$MIN_DRIVER-server, or the CUDA 13 \
driver from https://www.nvidia.com/drivers), reboot, check with nvidia-smi; in a container, run it with the GPUs \
(docker run --gpus all / the NVIDIA container toolkit). To build without a GPU: ARPO_SKIP_DRIVER_CHECK=1"
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "[check-driver] nvidia-smi not found: no NVIDIA driver is visible here, and the GPU environments' wheels are" \
       "CUDA 13 builds (driver >= $MIN_DRIVER). Fix: $fix" >&2
  exit 1
fi
if ! versions=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>&1) || [[ -z "$versions" ]]; then
  echo "[check-driver] nvidia-smi failed: ${versions:-no GPU listed}. Fix: $fix" >&2
  exit 1
fi
version=$(head -n1 <<<"$versions" | tr -d '[:space:]')
major=${version%%.*}
if ! [[ "$major" =~ ^[0-9]+$ ]]; then
  echo "[check-driver] cannot read the driver version from nvidia-smi: '$version'. Fix: $fix" >&2
  exit 1
fi
if (( major < MIN_DRIVER )); then
  echo "[check-driver] NVIDIA driver $version is too old: torch 2.11 / vLLM 0.24 (requirements/verl-gpu.lock) are" \
       "CUDA 13 builds and need driver >= $MIN_DRIVER. Fix: $fix" >&2
  exit 1
fi
echo "[check-driver] NVIDIA driver $version (>= $MIN_DRIVER, CUDA 13)"
