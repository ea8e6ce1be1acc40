"""Loading a policy for in-process generation and training: a ModelRef or a CheckpointRef (hf | lora | trainer)."""

from __future__ import annotations

from pathlib import Path

import torch

from stages.core.refs import CheckpointRef, ModelRef


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
