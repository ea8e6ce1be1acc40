"""Which engine trains the RL stage, the verl engine's settings, and the local engine's memory estimate.

`rl.engine: local` is the one-process trainer (stages/rl/trainer.py) on one device; `rl.engine: verl` runs verl's
PPO entry point over Ray with our algorithm plugged in (stages/rl/verl/, docs/rl.md "verl engine").

The local engine keeps float32 master weights and AdamW state whatever `model.dtype` says (`model.dtype` sets the
compute precision): 16 bytes per parameter (weights 4 + gradients 4 + AdamW moments 8), plus 4 bytes per
parameter for the frozen reference model when `rl.loss.kl_coef > 0`. With the vLLM rollout backend, vLLM reserves
`VLLM_GPU_MEMORY_UTILIZATION` of the device first. A model whose estimate exceeds what is left of
`rl.local_memory_gb` cannot train on the local engine: the config is refused naming `rl.engine: verl`.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field

from stages.core.config.section import Section

BYTES_PER_PARAM_TRAIN = 16       # fp32 weights + fp32 grads + two fp32 AdamW moments
BYTES_PER_PARAM_REFERENCE = 4    # the frozen fp32 reference policy (only with KL)
VLLM_GPU_MEMORY_UTILIZATION = 0.6  # stages.generation.vllm_backend.VLLMBackend's default share of the device
# config.json model_types whose packed single-row forward under sdpa (attention_mask None, position ids restarting
# per sequence: transformers builds the block-diagonal mask) equals the separate forwards through verl's own
# remove-padding path: tests/verl/test_remove_padding_sdpa.py checks each (docs/decisions.md "Attention: sdpa")
PACKED_SDPA_FAMILIES = ("llama", "qwen2", "qwen3")
_SIZE = re.compile(r"(?<![\d.])(\d+(?:\.\d+)?)\s*([bBmM])(?![a-zA-Z])")


class VerlSection(Section):
    """verl on Ray (`rl.engine: verl`). Every other RL setting comes from the rest of `rl:` through one
    mapping (stages/rl/verl/mapping.py, table in docs/rl.md)."""

    nnodes: int = Field(1, ge=1, description="trainer.nnodes: machines in the Ray cluster")
    n_gpus_per_node: int = Field(8, ge=1, description="trainer.n_gpus_per_node")
    rollout_tensor_parallel: int = Field(1, ge=1, description="vLLM tensor parallel size of one rollout replica")
    gpu_memory_utilization: float = Field(0.6, gt=0, lt=1, description="vLLM's share of each GPU (colocated)")
    param_offload: bool = Field(False, description="FSDP: keep actor parameters on the host between phases")
    optimizer_offload: bool = Field(False, description="FSDP: keep AdamW state on the host (needed for 3B on "
                                    "one 80 GB GPU)")
    max_token_len_per_gpu: int | None = Field(
        None, ge=1, description="dynamic batch size: tokens per GPU per forward (None = fixed micro batches of "
        "rl.trainer.micro_batch_size trajectories)")
    agent_workers: int = Field(8, ge=1, description="agent-loop worker processes (rollout.agent.num_workers)")
    reward_workers: int = Field(8, ge=1, description="verl reward-loop worker processes (reward.num_workers); "
                                "each loads verl and the tokenizer (~0.8 GB of RAM)")
    max_concurrent_trees: int = Field(64, ge=1, description="trees rolled out at once per agent-loop worker")
    stall_timeout_s: float | None = Field(
        3600.0, gt=0, description="the launcher's stall watchdog: no new step for this long (the first step "
        "includes loading the models and starting the servers) -> the stacks of the trainer and its workers go to "
        "<stage>/stacks/, the run stops with an error naming the stuck part, and re-running resumes from the "
        "newest checkpoint (stages/rl/verl/watchdog.py). None = no watchdog")
    ray_address: str | None = Field(None, description="join this Ray cluster (e.g. auto); None = start one")
    ray_num_cpus: int | None = Field(
        None, ge=1, description="logical CPUs of the Ray cluster verl starts (ray_init.num_cpus; Ray does not pin "
        "cores, so this may exceed the cores). None = what Ray counts here (the container's cgroup CPU quota, else the "
        "machine's cores). The pre-flight refuses a cluster that cannot hold TransferQueue's and the trainer's CPU "
        "reservations plus one free CPU per actor verl starts without one (stages/rl/verl/resources.py)")
    storage_units: int = Field(8, ge=1, description="TransferQueue SimpleStorage units (verl's default 8); each "
                               "reserves one Ray CPU for the whole run")
    attn_implementation: Literal["sdpa", "flash_attention_2", "eager"] = Field(
        "sdpa", description="attention of the FSDP actor (verl's default flash_attention_2 needs the flash-attn "
        "package, which verl[vllm] does not install; the pre-flight checks it)")
    remove_padding: bool | Literal["auto"] = Field(
        "auto", description="verl's remove-padding (actor_rollout_ref.model.use_remove_padding): each micro-batch "
        "packed into one row of its real tokens instead of padded to its longest sequence. auto = on with "
        "flash_attention_2, and with sdpa for the architecture families whose packed forward is verified "
        f"({', '.join(PACKED_SDPA_FAMILIES)}: docs/decisions.md \"Attention: sdpa\"); off otherwise")
    cpu_mode: bool = Field(False, description="verl on a CPU box (rehearsals, the suite's verl run): our CPU platform, "
                           "CPU overrides and environment (stages/rl/verl/cpu_mode.py); refused unless run.device is cpu")
    plugin_modules: list[str] = Field(
        default_factory=list, description="modules imported before our plugin in every verl process "
        "(VERL_USE_EXTERNAL_MODULES), e.g. a verl platform plugin for other hardware")
    logger: list[str] = Field(default_factory=lambda: ["console", "file"], description="trainer.logger backends")
    extra_overrides: list[str] = Field(default_factory=list,
                                       description="raw hydra overrides appended last (escape hatch)")

    def uses_remove_padding(self, model_type: str | None) -> bool:
        """Whether verl packs micro-batches (use_remove_padding) for a policy of this config.json model_type (None:
        unknown). `auto`: flash-attn's varlen kernel keeps packed sequences apart for any model; under sdpa only
        the families verified on verl's own path do (transformers' mask from packed position ids)."""
        if self.remove_padding != "auto":
            return bool(self.remove_padding)
        if self.attn_implementation == "flash_attention_2":
            return True
        return self.attn_implementation == "sdpa" and model_type in PACKED_SDPA_FAMILIES


def params_from_name(*names: str | None) -> float | None:
    """Billions of parameters read from a model name such as 'Qwen2.5-7B-Instruct' or 'SmolLM2-135M' (the last
    size in the first name that has one); None when no name says."""
    for name in names:
        hits = _SIZE.findall(name or "")
        if hits:
            value, unit = hits[-1]
            return float(value) / (1000.0 if unit.lower() == "m" else 1.0)
    return None


def local_memory_estimate_gb(params_billion: float, kl: bool) -> float:
    """GB the local engine needs for weights, gradients, optimizer (and reference) state."""
    per_param = BYTES_PER_PARAM_TRAIN + (BYTES_PER_PARAM_REFERENCE if kl else 0)
    return params_billion * per_param


def local_engine_problem(params_billion: float, device_gb: float, backend: str, kl: bool) -> str | None:
    """Why the local engine cannot train this model on one device of `device_gb`, or None when it fits."""
    need = local_memory_estimate_gb(params_billion, kl)
    usable = device_gb * (1 - VLLM_GPU_MEMORY_UTILIZATION) if backend == "vllm" else device_gb
    if need <= usable:
        return None
    vllm = f" after vLLM's {VLLM_GPU_MEMORY_UTILIZATION:.0%}" if backend == "vllm" else ""
    return (f"the local RL engine needs ~{need:.0f} GB for a {params_billion:g}B-parameter policy (fp32 weights, "
            f"gradients and AdamW state: {BYTES_PER_PARAM_TRAIN} B/param{', plus the reference model' if kl else ''})"
            f" but one device has {usable:.0f} GB{vllm} (rl.local_memory_gb={device_gb:g}). Set rl.engine: verl "
            "to train it with FSDP over several GPUs (README: GPU runbook), or pick a smaller model")
