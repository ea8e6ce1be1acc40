"""The pure LLaMA-Factory config builders against hand-written expected dicts, and the launch commands."""

from __future__ import annotations

import pytest

from stages.core.config.loader import ConfigError, load_config
from stages.core.config.sft import DPOSection, SFTSection
from stages.core.env import PROJECT_ROOT
from stages.sft.lf_config import dpo_train_args, export_args, export_command, sft_train_args, train_command

PATHS = dict(model_path="/models/qwen", template="qwen", dataset_dir="/run/dataset", dataset="arpo_sft",
             output_dir="/run/trainer")


def test_paper_profile_matches_the_reference_qwen_yaml() -> None:
    cfg = load_config("arpo-qwen2.5-7b-reasoning").sft
    # docs/reference.md "SFT recipe": full FT, ZeRO-3, template qwen, cutoff 15000, lr 7e-6, 3 epochs, cosine, warmup 0.1,
    # bf16, per-device batch 1 x grad-acc 2 (x 8 GPUs = global 16)
    assert sft_train_args(cfg, **PATHS) == {
        "model_name_or_path": "/models/qwen", "trust_remote_code": True, "stage": "sft", "do_train": True,
        "finetuning_type": "full",
        "deepspeed": str(PROJECT_ROOT / "configs" / "deepspeed" / "ds_z3_offload.json"),
        "dataset": "arpo_sft", "dataset_dir": "/run/dataset", "template": "qwen", "cutoff_len": 15000,
        "overwrite_cache": True, "preprocessing_num_workers": 16, "dataloader_num_workers": 4,
        "output_dir": "/run/trainer", "logging_steps": 1, "save_strategy": "steps", "save_steps": 500,
        "save_total_limit": 2, "plot_loss": True, "overwrite_output_dir": False, "report_to": "none",
        "per_device_train_batch_size": 1, "gradient_accumulation_steps": 2, "learning_rate": 7e-6,
        "num_train_epochs": 3.0, "lr_scheduler_type": "cosine", "warmup_ratio": 0.1, "bf16": True, "fp16": False,
        "ddp_timeout": 180000000, "seed": 42,
    }
    assert (PROJECT_ROOT / "configs" / "deepspeed" / "ds_z3_offload.json").is_file()


def test_tiny_profile_runs_on_cpu_without_mixed_precision() -> None:
    cfg = load_config("tiny-cpu").sft
    args = sft_train_args(cfg, **(PATHS | {"template": "smollm2"}))
    assert {k: args[k] for k in ("bf16", "fp16", "report_to", "preprocessing_num_workers", "dataloader_num_workers",
                                 "max_steps", "per_device_train_batch_size", "gradient_accumulation_steps",
                                 "cutoff_len", "template")} == {
        "bf16": False, "fp16": False, "report_to": "none", "preprocessing_num_workers": 1,
        "dataloader_num_workers": 0, "max_steps": 12, "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 1, "cutoff_len": 1024, "template": "smollm2"}
    assert "deepspeed" not in args and "resume_from_checkpoint" not in args and "tokenized_path" not in args


def test_lora_masking_resume_and_extra_args() -> None:
    cfg = SFTSection(finetuning_type="lora", lora_rank=16, lora_alpha=32, max_steps=5,
                     extra_args={"flash_attn": "fa2", "learning_rate": 1e-4})
    args = sft_train_args(cfg, **PATHS, tokenized_path="/run/tokenized", resume_from="/run/trainer/checkpoint-4")
    assert (args["finetuning_type"], args["lora_rank"], args["lora_alpha"], args["lora_target"]) == \
        ("lora", 16, 32, "all")
    assert args["tokenized_path"] == "/run/tokenized"
    assert args["resume_from_checkpoint"] == "/run/trainer/checkpoint-4"
    assert args["max_steps"] == 5
    # extra_args go last and win
    assert args["flash_attn"] == "fa2" and args["learning_rate"] == 1e-4


def test_dpo_args_follow_toolstar_lora_dpo() -> None:
    sft = load_config("tiny-cpu").sft
    args = dpo_train_args(DPOSection(enabled=True), sft, model_path="/run/sft/model", template="smollm2",
                          dataset_dir="/run/pairs", dataset="self_critic", output_dir="/run/dpo")
    # Tool-Star qwen_lora_dpo_2.yaml: LoRA r 8, beta 0.1, sigmoid, cutoff 8192, lr 5e-6, 3 epochs
    assert {k: args[k] for k in ("stage", "finetuning_type", "lora_rank", "pref_beta", "pref_loss", "cutoff_len",
                                 "learning_rate", "num_train_epochs", "bf16", "dataset", "model_name_or_path")} == {
        "stage": "dpo", "finetuning_type": "lora", "lora_rank": 8, "pref_beta": 0.1, "pref_loss": "sigmoid",
        "cutoff_len": 8192, "learning_rate": 5e-6, "num_train_epochs": 3.0, "bf16": False, "dataset": "self_critic",
        "model_name_or_path": "/run/sft/model"}


def test_export_args_pin_the_dtype() -> None:
    args = export_args(model_path="/m", adapter_path="/a", template="smollm2", export_dir="/out", bf16=False)
    assert args == {"model_name_or_path": "/m", "adapter_name_or_path": "/a", "trust_remote_code": True,
                    "template": "smollm2", "finetuning_type": "lora", "export_dir": "/out", "export_size": 5,
                    "export_device": "cpu", "export_legacy_format": False, "infer_dtype": "float32"}
    assert export_args(model_path="/m", adapter_path="/a", template="t", export_dir="/o", bf16=True,
                       device="auto")["infer_dtype"] == "bfloat16"
    assert export_command("/run/export.yaml", "/venv/bin") == ["/venv/bin/llamafactory-cli", "export",
                                                               "/run/export.yaml"]


def test_train_commands() -> None:
    assert train_command("python", 1, "/run/train.yaml", "/venv/bin") == \
        ["/venv/bin/llamafactory-cli", "train", "/run/train.yaml"]
    # the reference sft_train.sh: torchrun over llamafactory's launcher module
    assert train_command("torchrun", 8, "/run/train.yaml", "/venv/bin", env={}, master_port=29511) == [
        "/venv/bin/torchrun", "--nnodes", "1", "--node_rank", "0", "--nproc_per_node", "8",
        "--master_addr", "127.0.0.1", "--master_port", "29511", "-m", "llamafactory.launcher", "/run/train.yaml"]
    multi = train_command("torchrun", 8, "/t.yaml", "/b", env={"NNODES": "2", "NODE_RANK": "1",
                                                               "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "6000"})
    assert multi[1:11] == ["--nnodes", "2", "--node_rank", "1", "--nproc_per_node", "8", "--master_addr",
                           "10.0.0.1", "--master_port", "6000"]
    with pytest.raises(ValueError, match="sft.launcher"):
        train_command("mpirun", 1, "/t.yaml", "/b")


def test_config_validation_names_the_fix() -> None:
    with pytest.raises(ConfigError, match="sft.dataset_path"):
        load_config("tiny-cpu", ["sft.dataset=file"])
    with pytest.raises(ConfigError, match="DeepSpeed .json"):
        load_config("tiny-cpu", ["sft.deepspeed=configs/deepspeed/ds.yaml"])
    with pytest.raises(ConfigError, match="sft.dpo.dataset_path"):
        load_config("tiny-cpu", ["sft.dpo.enabled=true", "sft.dpo.source=file"])
    # disabled SFT needs no dataset
    assert load_config("tiny-cpu", ["sft.enabled=false", "sft.dataset=file"]).sft.enabled is False


def test_preflight_names_missing_deepspeed_pieces() -> None:
    import importlib.util

    from stages.sft.stage import preflight

    with pytest.raises(FileNotFoundError, match="nope.json"):
        preflight(SFTSection(deepspeed="configs/deepspeed/nope.json"))
    shipped = SFTSection(deepspeed="configs/deepspeed/ds_z3_offload.json")
    if importlib.util.find_spec("deepspeed") is None:  # the CPU environment: say how to install it
        with pytest.raises(ModuleNotFoundError, match=r"scripts/setup-gpu.sh \(it installs deepspeed=="):
            preflight(shipped)
    else:
        preflight(shipped)
    preflight(SFTSection())  # plain CPU/GPU run without DeepSpeed: nothing to check
