from __future__ import annotations

from typing import Literal

from pydantic import Field

from stages.core.config.section import Section


class DPOSection(Section):
    """Optional self-critic DPO after SFT (Tool-Star: LoRA r 8, beta 0.1, sigmoid)."""

    enabled: bool = False
    beta: float = 0.1
    loss: Literal["sigmoid", "hinge", "ipo"] = "sigmoid"
    lora_rank: int = 8
    learning_rate: float = 5e-6
    num_train_epochs: float = 3.0
    max_steps: int | None = None
    samples_per_question: int = Field(4, ge=2, description="trajectories sampled per question to form pairs")


class SFTSection(Section):
    """Cold-start SFT with LLaMA-Factory (reference: full FT, lr 7e-6, 3 epochs, cosine, warmup 0.1)."""

    enabled: bool = True
    dataset: Literal["teacher", "file"] = Field("teacher", description="teacher = trajectories made here")
    dataset_path: str | None = Field(None, description="ARPO-SFT (sharegpt) or Tool-Star-SFT (alpaca) file")
    dataset_format: Literal["sharegpt", "alpaca"] = "sharegpt"
    n_trajectories: int = Field(64, ge=1, description="teacher trajectories to build (dataset=teacher)")
    mask_tool_results: bool = Field(False, description="no loss on <result> tokens (reference: False)")
    finetuning_type: Literal["full", "lora"] = "full"
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_target: str = "all"
    learning_rate: float = 7e-6
    num_train_epochs: float = 3.0
    max_steps: int | None = None
    per_device_train_batch_size: int = 1
    gradient_accumulation_steps: int = 2
    cutoff_len: int = 15000
    warmup_ratio: float = 0.1
    lr_scheduler_type: str = "cosine"
    bf16: bool = True
    deepspeed: str | None = Field(None, description="DeepSpeed json, e.g. a ZeRO-3 config")
    launcher: Literal["python", "torchrun"] = "python"
    nproc_per_node: int = 1
    logging_steps: int = 1
    extra_args: dict[str, str | int | float | bool] = Field(default_factory=dict,
                                                             description="passed to LLaMA-Factory unchanged")
    dpo: DPOSection = DPOSection()
