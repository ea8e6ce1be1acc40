from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic.fields import FieldInfo

from stages.core.config.section import Section, registry, used_when
from stages.core.input_files import input_file

LORA = used_when(finetuning_type="lora")  # SFT only: DPO has no finetuning_type (always LoRA)
SFT_FILE = used_when(dataset="file")
SAMPLED = used_when(source="sampled")

Scalar = str | int | float | bool


class TrainingSection(Section):
    """The LLaMA-Factory training settings SFT and DPO share, defined once (the defaults are SFT's reference
    values: full FT, lr 7e-6, 3 epochs; DPOSection re-declares the three whose Tool-Star defaults differ)."""

    learning_rate: float = Field(7e-6, gt=0, description="LLaMA-Factory learning_rate (peak, before the schedule)")
    num_train_epochs: float = Field(3.0, gt=0, description="passes over the dataset (LLaMA-Factory "
                                    "num_train_epochs)")
    max_steps: int | None = Field(None, ge=1, description="None = num_train_epochs over the data")
    per_device_train_batch_size: int = Field(1, ge=1, description="rows per device per forward/backward; the "
                                             "global batch is this x gradient_accumulation_steps x devices")
    gradient_accumulation_steps: int = Field(2, ge=1, description="forward/backward passes per optimizer step")
    cutoff_len: int = Field(15000, ge=16, description="tokens per row; longer rows are cut (LLaMA-Factory "
                            "cutoff_len)")
    lora_rank: int = Field(8, ge=1, description="LoRA rank r", json_schema_extra=LORA)
    lora_alpha: int = Field(16, ge=1, description="LoRA scaling alpha (the update is scaled by alpha / r)",
                            json_schema_extra=LORA)
    lora_target: str = Field("all", description="modules LoRA adapts: all = every linear layer, or a comma list "
                             "of module names (LLaMA-Factory lora_target)", json_schema_extra=LORA)


def _redefault(name: str, default: float) -> FieldInfo:
    """TrainingSection's field `name` (its bounds and description) with another default."""
    return FieldInfo.merge_field_infos(TrainingSection.model_fields[name], default=default)


class DPOSection(TrainingSection):
    """Optional self-critic DPO after SFT (Tool-Star `qwen_lora_dpo_2.yaml`: LoRA r 8, beta 0.1, sigmoid, lr 5e-6,
    batch 2 x gradient accumulation 2 per device, cutoff 8192)."""

    # Tool-Star's values where they differ from SFT's (the rest of TrainingSection as is)
    learning_rate: float = _redefault("learning_rate", 5e-6)
    per_device_train_batch_size: int = _redefault("per_device_train_batch_size", 2)
    gradient_accumulation_steps: int = _redefault("gradient_accumulation_steps", 2)
    cutoff_len: int = _redefault("cutoff_len", 8192)
    enabled: bool = Field(False, description="run a DPO round on the SFT checkpoint (stage `dpo`, part of sft); "
                          "false = the SFT policy goes to RL as is")
    source: Literal["sampled", "file"] = Field(
        "sampled", description="sampled = pairs from trajectories the SFT checkpoint samples with real tools; "
                               "file = a LLaMA-Factory sharegpt ranking file (conversations/chosen/rejected)")
    dataset_path: str | None = Field(None, description="source=file: the preference pairs file (.json/.jsonl)",
                                     json_schema_extra={**used_when(source="file"), **input_file("records")})
    beta: float = Field(0.1, gt=0, description="LLaMA-Factory pref_beta")
    loss: Literal["sigmoid", "hinge", "ipo"] = Field("sigmoid", description="LLaMA-Factory pref_loss")
    ftx: float = Field(0.0, ge=0, description="pref_ftx: SFT loss weight added to the DPO loss")
    max_questions: int | None = Field(64, ge=1, description="train questions sampled for pairs (None = all)",
                                      json_schema_extra=SAMPLED)
    samples_per_question: int = Field(4, ge=2, description="trajectories sampled per question to form pairs",
                                      json_schema_extra=SAMPLED)
    pairs_per_question: int = Field(1, ge=1, description="at most this many (correct, incorrect) pairs each",
                                    json_schema_extra=SAMPLED)
    temperature: float = Field(1.0, gt=0, description="sampling temperature for the pair trajectories",
                               json_schema_extra=SAMPLED)
    max_new_tokens: int = Field(512, ge=8, description="response tokens per sampled trajectory (results included)",
                                json_schema_extra=SAMPLED)
    rollout_backend: str = Field("transformers", description="sampling (generation) backend: transformers | vllm",
                                 json_schema_extra={**SAMPLED, **registry("generation backend")})
    reward: str = Field("reference", description="reward function deciding which samples are correct",
                        json_schema_extra={**SAMPLED, **registry("reward function")})
    chosen_fallback: Literal["teacher", "gold", "none"] = Field(
        "teacher", description="for a question none of whose samples is correct: teacher = its teacher trajectory "
                               "(the generated task set only) is the chosen side; gold = a minimal well-formed answer "
                               "with its ground truth, no tool call (stages.agent.protocol.minimal_answer); none = "
                               "no pair (Tool-Star: pairs are the policy's own samples only)",
        json_schema_extra=SAMPLED)

    @model_validator(mode="after")
    def _file_needs_path(self) -> DPOSection:
        if self.enabled and self.source == "file" and not self.dataset_path:
            raise ValueError("sft.dpo.source=file needs sft.dpo.dataset_path (a sharegpt ranking .json/.jsonl)")
        return self


class SFTSection(TrainingSection):
    """Cold-start SFT with LLaMA-Factory (reference: full FT, lr 7e-6, 3 epochs, cosine, warmup 0.1, ZeRO-3)."""

    enabled: bool = Field(True, description="false = hand the input model on unchanged")
    dataset: Literal["teacher", "file"] = Field(
        "teacher", description="teacher = tool trajectories built here from the generated train tasks; "
                               "file = dataset_path in dataset_format")
    dataset_path: str | None = Field(None, description="ARPO-SFT (sharegpt) or Tool-Star-SFT (alpaca) .json/.jsonl/"
                                                       ".parquet file (dataset=file)",
                                    json_schema_extra={**SFT_FILE, **input_file("records")})
    dataset_format: Literal["sharegpt", "alpaca"] = Field("sharegpt", description="layout of dataset_path",
                                                          json_schema_extra=SFT_FILE)
    bad_rows: Literal["error", "skip"] = Field("skip", description="skip = log file+row of each bad row, go on",
                                               json_schema_extra=SFT_FILE)
    max_samples: int | None = Field(None, ge=1, description="use only the first N valid rows of dataset_path",
                                    json_schema_extra=SFT_FILE)
    n_trajectories: int = Field(64, ge=1, description="teacher trajectories to build (dataset=teacher)")
    teacher_seed: int = Field(0, description="seed of the teacher's wording choices")
    mask_tool_results: bool = Field(False, description="no loss on <result> tokens (reference: False, ARPO #9)")
    template: str | None = Field(None, description="LLaMA-Factory chat template; None = the model's template")
    finetuning_type: Literal["full", "lora"] = Field(
        "full", description="full = every weight trains (the reference); lora = an adapter, merged into a plain HF "
        "folder afterwards (llamafactory-cli export)")
    warmup_ratio: float = Field(0.1, ge=0, lt=1, description="share of the steps the learning rate warms up over "
                                "(SFT and DPO)")
    lr_scheduler_type: str = Field("cosine", description="transformers' scheduler name (LLaMA-Factory "
                                   "lr_scheduler_type), for SFT and DPO")
    bf16: bool = Field(True, description="train in bfloat16 mixed precision (SFT and DPO; a LoRA merge exports "
                       "bfloat16, else float32)")
    seed: int = Field(42, description="the trainer's seed (SFT and DPO) and the seed of DPO's pair sampling")
    deepspeed: str | None = Field(None, description="DeepSpeed json, e.g. configs/deepspeed/ds_z3_offload.json "
                                  "(relative to the project root)",
                                  json_schema_extra=input_file("file", project_relative=True))
    launcher: Literal["python", "torchrun"] = Field(
        "python", description="python = `llamafactory-cli train`; torchrun = torchrun -m llamafactory.launcher")
    nproc_per_node: int = Field(1, ge=1, description="torchrun processes (GPUs) per node",
                                json_schema_extra=used_when(launcher="torchrun"))
    preprocessing_num_workers: int = Field(16, ge=1, description="processes that tokenize the dataset (SFT and DPO)")
    dataloader_num_workers: int = Field(4, ge=0, description="data loader worker processes; 0 = load in the main "
                                        "process (SFT and DPO)")
    logging_steps: int = Field(1, ge=1, description="a loss line every N optimizer steps (SFT and DPO)")
    save_steps: int = Field(500, ge=1, description="trainer checkpoint every N steps (resume point after a crash)")
    save_total_limit: int = Field(2, ge=1, description="trainer checkpoints kept while training (older ones are "
                                  "deleted; SFT and DPO)")
    keep_checkpoints: bool = Field(False, description="keep trainer checkpoint-* folders after a finished run")
    extra_args: dict[str, Scalar] = Field(default_factory=dict, description="passed to LLaMA-Factory unchanged")
    dpo: DPOSection = DPOSection()

    @model_validator(mode="after")
    def _consistent(self) -> SFTSection:
        if self.enabled and self.dataset == "file" and not self.dataset_path:
            raise ValueError("sft.dataset=file needs sft.dataset_path (an ARPO-SFT sharegpt or Tool-Star alpaca file)")
        if self.deepspeed and not self.deepspeed.endswith(".json"):
            raise ValueError(f"sft.deepspeed={self.deepspeed!r} must be a DeepSpeed .json config "
                             "(e.g. configs/deepspeed/ds_z3_offload.json)")
        return self
