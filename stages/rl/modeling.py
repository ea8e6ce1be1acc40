"""Loading the policy the RL and merge stages start from: a ModelRef or a CheckpointRef (hf | lora | trainer)."""

from __future__ import annotations

from pathlib import Path

import torch

from stages.core.refs import CheckpointRef, ModelRef

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


def policy_folder(policy: ModelRef | CheckpointRef) -> Path:
    """The HF folder holding the policy's weights (for a LoRA checkpoint: the adapter folder)."""
    path = Path(policy.path)
    if isinstance(policy, CheckpointRef) and policy.format == "trainer":
        path = path / "model"
    if not path.is_dir():
        raise FileNotFoundError(f"policy folder {path} does not exist; was the upstream stage output deleted? "
                                "Re-run the upstream stage (or pass force=True)")
    marker = "adapter_config.json" if isinstance(policy, CheckpointRef) and policy.format == "lora" \
        else "config.json"
    if not (path / marker).is_file():
        raise FileNotFoundError(f"{path} has no {marker}: it is not a Hugging Face "
                                f"{'LoRA adapter' if marker.startswith('adapter') else 'model'} folder")
    return path


def tokenizer_folder(policy: ModelRef | CheckpointRef) -> Path:
    """Where the tokenizer lives: the policy folder, or for a LoRA adapter without one, the base model."""
    folder = policy_folder(policy)
    if any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return folder
    if isinstance(policy, CheckpointRef) and policy.base is not None:
        return Path(policy.base.path)
    raise FileNotFoundError(f"no tokenizer in {folder} and no base model to take it from")


def load_tokenizer(policy: ModelRef | CheckpointRef):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_folder(policy)))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(policy: ModelRef | CheckpointRef, dtype: torch.dtype = torch.float32,
                merge_lora: bool = True) -> torch.nn.Module:
    """An AutoModelForCausalLM with sdpa attention; a LoRA checkpoint is loaded over its base and, with
    `merge_lora`, merged into plain weights (peft merge_and_unload)."""
    from transformers import AutoModelForCausalLM

    folder = policy_folder(policy)
    if isinstance(policy, CheckpointRef) and policy.format == "lora":
        from peft import PeftModel

        if policy.base is None:
            raise ValueError(f"LoRA checkpoint {folder} has no base ModelRef; the SFT stage must set `base`")
        base = AutoModelForCausalLM.from_pretrained(policy.base.path, dtype=dtype, attn_implementation="sdpa")
        model = PeftModel.from_pretrained(base, str(folder))
        return model.merge_and_unload() if merge_lora else model
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation="sdpa")
