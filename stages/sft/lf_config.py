"""Pure builders: our config sections -> LLaMA-Factory argument dicts (written as YAML) and launch commands.

The keys follow the reference `arpo_train_sft/yaml/qwen.yaml` (docs/reference.md "SFT recipe"): full FT, cutoff
15000, lr 7e-6, 3 epochs, cosine, warmup 0.1, bf16, DeepSpeed ZeRO-3; the tiny profile flips bf16 off and
shrinks the run. Nothing here touches the disk or the environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.core.config.sft import DPOSection, SFTSection, TrainingSection
from stages.core.env import PROJECT_ROOT

DDP_TIMEOUT = 180000000  # the LLaMA-Factory examples' value: long preprocessing must not trip NCCL timeouts


def resolve_project_path(path: str) -> str:
    """Relative config paths (configs/deepspeed/...) are relative to the project root."""
    candidate = Path(path).expanduser()
    return str(candidate if candidate.is_absolute() else (PROJECT_ROOT / candidate).resolve())


def _lora(training: TrainingSection) -> dict[str, Any]:
    return {"lora_rank": training.lora_rank, "lora_alpha": training.lora_alpha, "lora_target": training.lora_target}


def sft_train_args(cfg: SFTSection, *, model_path: str, template: str, dataset_dir: str, dataset: str,
                   output_dir: str, tokenized_path: str | None = None,
                   resume_from: str | None = None, report_to: str = "none",
                   run_name: str | None = None) -> dict[str, Any]:
    """The LLaMA-Factory `train` arguments of one SFT run.

    `tokenized_path`: a pre-tokenized dataset (result-masked labels); LLaMA-Factory then loads it and skips its
    own preprocessing. `resume_from`: a trainer checkpoint folder to continue from after a crash. `report_to` /
    `run_name`: the tracker the stage's run hands its logging to (stages.core.tracking Handoff: mlflow, wandb,
    tensorboard or none) and that run's name, which Hugging Face's MLflow callback would otherwise rename.
    """
    args: dict[str, Any] = {
        "model_name_or_path": model_path,
        "trust_remote_code": True,
        "stage": "sft",
        "do_train": True,
        "finetuning_type": cfg.finetuning_type,
    }
    if cfg.finetuning_type == "lora":
        args |= _lora(cfg)
    if cfg.deepspeed:
        args["deepspeed"] = resolve_project_path(cfg.deepspeed)
    args |= {
        "dataset": dataset,
        "dataset_dir": dataset_dir,
        "template": template,
        "cutoff_len": cfg.cutoff_len,
        "overwrite_cache": True,
        "preprocessing_num_workers": cfg.preprocessing_num_workers,
        "dataloader_num_workers": cfg.dataloader_num_workers,
    }
    if tokenized_path:
        args["tokenized_path"] = tokenized_path
    args |= _output_args(cfg.logging_steps, cfg.save_steps, cfg.save_total_limit, output_dir, report_to, run_name)
    args |= _optim_args(cfg, cfg, resume_from)
    return args | dict(cfg.extra_args)


def _optim_args(sft: SFTSection, training: TrainingSection, resume_from: str | None) -> dict[str, Any]:
    """Batch, schedule and precision: `training` (SFT's or DPO's) for batch/lr/epochs/steps, SFT's schedule,
    precision and seed."""
    args: dict[str, Any] = {
        "per_device_train_batch_size": training.per_device_train_batch_size,
        "gradient_accumulation_steps": training.gradient_accumulation_steps,
        "learning_rate": training.learning_rate,
        "num_train_epochs": training.num_train_epochs,
        "lr_scheduler_type": sft.lr_scheduler_type,
        "warmup_ratio": sft.warmup_ratio,
        "bf16": sft.bf16,
        "fp16": False,
        "ddp_timeout": DDP_TIMEOUT,
        "seed": sft.seed,
    }
    if training.max_steps is not None:
        args["max_steps"] = training.max_steps
    if resume_from:
        args["resume_from_checkpoint"] = resume_from
    return args


def _output_args(logging_steps: int, save_steps: int, save_total_limit: int, output_dir: str,
                 report_to: str = "none", run_name: str | None = None) -> dict[str, Any]:
    return {
        "output_dir": output_dir,
        "logging_steps": logging_steps,
        "save_strategy": "steps",
        "save_steps": save_steps,
        "save_total_limit": save_total_limit,
        "plot_loss": True,
        "overwrite_output_dir": False,  # we decide resume vs fresh start ourselves (stages.sft.runner)
        "report_to": report_to,
        **({"run_name": run_name} if run_name else {}),
    }


def dpo_train_args(dpo: DPOSection, sft: SFTSection, *, model_path: str, template: str, dataset_dir: str,
                   dataset: str, output_dir: str, resume_from: str | None = None, report_to: str = "none",
                   run_name: str | None = None) -> dict[str, Any]:
    """LLaMA-Factory DPO over a sharegpt ranking dataset, LoRA on top of the SFT checkpoint (`report_to`,
    `run_name`: as sft_train_args)."""
    args: dict[str, Any] = {
        "model_name_or_path": model_path,
        "trust_remote_code": True,
        "stage": "dpo",
        "do_train": True,
        "finetuning_type": "lora",
        **_lora(dpo),
        "pref_beta": dpo.beta,
        "pref_loss": dpo.loss,
        "pref_ftx": dpo.ftx,
    }
    if sft.deepspeed:
        args["deepspeed"] = resolve_project_path(sft.deepspeed)
    args |= {
        "dataset": dataset,
        "dataset_dir": dataset_dir,
        "template": template,
        "cutoff_len": dpo.cutoff_len,
        "overwrite_cache": True,
        "preprocessing_num_workers": sft.preprocessing_num_workers,
        "dataloader_num_workers": sft.dataloader_num_workers,
    }
    args |= _output_args(sft.logging_steps, sft.save_steps, sft.save_total_limit, output_dir, report_to, run_name)
    return args | _optim_args(sft, dpo, resume_from)


def export_args(*, model_path: str, adapter_path: str, template: str, export_dir: str, bf16: bool,
                device: str = "cpu") -> dict[str, Any]:
    """`llamafactory-cli export`: merge a LoRA adapter into its base and save a plain HF folder.

    The dtype is explicit: with `infer_dtype: auto` LLaMA-Factory would turn a float32 model into bfloat16.
    """
    return {
        "model_name_or_path": model_path,
        "adapter_name_or_path": adapter_path,
        "trust_remote_code": True,
        "template": template,
        "finetuning_type": "lora",
        "export_dir": export_dir,
        "export_size": 5,
        "export_device": device,
        "export_legacy_format": False,
        "infer_dtype": "bfloat16" if bf16 else "float32",
    }


def train_command(launcher: str, nproc_per_node: int, yaml_path: str, bin_dir: str,
                  env: dict[str, str] | None = None, master_port: int = 29500) -> list[str]:
    """The command line that runs one LLaMA-Factory training config.

    python: `llamafactory-cli train cfg.yaml` (which itself goes distributed when it sees several GPUs).
    torchrun: `torchrun ... -m llamafactory.launcher cfg.yaml`, as the reference `sft_train.sh` does; node
    count, rank and master come from NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT when set.
    """
    env = env or {}
    if launcher == "python":
        return [str(Path(bin_dir) / "llamafactory-cli"), "train", yaml_path]
    if launcher == "torchrun":
        return [str(Path(bin_dir) / "torchrun"),
                "--nnodes", env.get("NNODES", "1"),
                "--node_rank", env.get("NODE_RANK", "0"),
                "--nproc_per_node", str(nproc_per_node),
                "--master_addr", env.get("MASTER_ADDR", "127.0.0.1"),
                "--master_port", env.get("MASTER_PORT", str(master_port)),
                "-m", "llamafactory.launcher", yaml_path]
    raise ValueError(f"unknown sft.launcher {launcher!r}; use 'python' or 'torchrun'")


def export_command(yaml_path: str, bin_dir: str) -> list[str]:
    return [str(Path(bin_dir) / "llamafactory-cli"), "export", yaml_path]
