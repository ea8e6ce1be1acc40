"""The local RL engine's model set-up: compute precision, gradient checkpointing, size and device memory.

Loading a policy (a ModelRef or a CheckpointRef) is shared with SFT sampling: stages/generation/models.py."""

from __future__ import annotations

from pathlib import Path

import torch

from stages.core.refs import CheckpointRef, ModelRef
from stages.generation.models import policy_folder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def compute_dtype(name: str) -> torch.dtype:
    """The local trainer's compute precision for `model.dtype`. Weights and AdamW state stay float32 (master
    copies): at RL learning rates (1e-6) an update is far below bfloat16's resolution of a weight (~4e-3 relative),
    so bfloat16 weights would not train at all. bfloat16 runs forward/backward under autocast; float16 would need
    loss scaling, which this trainer does not do."""
    if name == "float16":
        raise ValueError("model.dtype=float16 is not supported by the local RL engine (no loss scaling); use "
                         "bfloat16 (compute) or float32")
    return DTYPES[name]


def configure_for_training(model: torch.nn.Module, gradient_checkpointing: bool) -> torch.nn.Module:
    """Gradient checkpointing (recompute activations in backward; the KV cache is off while it is on)."""
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model


def parameters_billion(policy: ModelRef | CheckpointRef) -> float:
    """Exact parameter count of the policy in billions, from its config on the meta device (no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(policy.base.path) if isinstance(policy, CheckpointRef) and policy.format == "lora" \
        and policy.base is not None else policy_folder(policy)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)))
    return sum(p.numel() for p in model.parameters()) / 1e9


def device_memory_gb(device: torch.device, configured_gb: float) -> float:
    """Total memory of the CUDA device, else the configured value (rl.local_memory_gb)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 1e9
    return configured_gb


def pick_device() -> torch.device:
    """CUDA when available, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
