"""The SFT stage entry point: dataset -> (result masking) -> LLaMA-Factory training -> plain HF folder.

Output folder `<output_root>/sft/<key>/`:
  dataset/       LLaMA-Factory dataset folder (dataset_info.json + arpo_sft.jsonl + counts.json)
  tokenized/     pre-tokenized, result-masked dataset (only with sft.mask_tool_results)
  train.yaml     the exact LLaMA-Factory config;  train.log  its full output
  trainer/       LLaMA-Factory output_dir (trainer_log.jsonl, checkpoint-N while running, LoRA adapter)
  model/         the HF checkpoint handed on (merged for LoRA)
  loss.png, metrics.json
Every step is skipped when its output is already there, so a crashed run resumes; training itself resumes
from the newest trainer checkpoint.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from stages.core import tracking
from stages.core.atomic import atomic_path, write_json, write_yaml
from stages.core.codeversion import code_version
from stages.core.config.agent import AgentSection
from stages.core.config.sft import SFTSection
from stages.core.env import PROJECT_ROOT
from stages.core.errors import MissingInputError
from stages.core.fingerprint import hash_value
from stages.core.input_files import hash_input
from stages.core.log import get_logger
from stages.core.refs import CheckpointRef, DatasetRef, ModelRef
from stages.core.templates import load_template
from stages.core.workspace import StageDir, stage_dir
from stages.sft import lf_config
from stages.sft.dataset import DATASET_NAME, prepare_sft_dataset
from stages.sft.masking import STATS_FILE
from stages.sft.runner import bin_dir, resume_point, run_config, run_streaming, subprocess_env, training_metrics

log = get_logger(__name__)

_HF_FILES = re.compile(r"^(config\.json|generation_config\.json|.*\.safetensors|model\.safetensors\.index\.json|"
                       r"tokenizer.*|special_tokens_map\.json|chat_template\.jinja|vocab\.json|merges\.txt|"
                       r"added_tokens\.json|.*\.tiktoken|.*\.model)$")


def passthrough(model: ModelRef, why: str) -> CheckpointRef:
    """The input model as a checkpoint, unchanged (SFT disabled)."""
    return CheckpointRef(path=model.path, fingerprint=model.fingerprint, format="hf", base=model,
                         meta={"skipped": why, "template": model.template})


def teacher_key_inputs(agent: AgentSection, data: DatasetRef | None) -> list[Any]:
    """What teacher trajectories depend on: the task set, the system prompt, and the agent settings that shape
    tool output text (search backend/top-k/passage size, python output cap). Tool-call limits and the tool
    cache do not, so changing them for RL or evaluation keeps SFT cached."""
    return [data.fingerprint if data else None, agent.prompt_template, load_template(agent.prompt_template),
            agent.search, agent.python.max_output_chars]


def sft_key(cfg: SFTSection, agent: AgentSection, model: ModelRef, data: DatasetRef | None) -> str:
    """What the SFT output depends on. Not the DPO block (its own stage), not later stages' sections."""
    if cfg.dataset == "teacher":
        inputs: Any = teacher_key_inputs(agent, data)
    else:
        inputs = [hash_input(cfg.dataset_path or "", "sft.dataset_path")]
    return hash_value(cfg.model_dump(mode="json", exclude={"dpo"}), model.fingerprint, inputs,
                      code_version(__name__))


def local_path(path: str) -> str:
    """An absolute path: LLaMA-Factory runs in the run folder, and a relative folder name would be taken for
    a hub id there."""
    return str(Path(path).expanduser().resolve())


def template_of(cfg: SFTSection, model: ModelRef) -> str:
    template = cfg.template or model.template
    if not template:
        raise ValueError(f"no LLaMA-Factory chat template for {model.name or model.path}: set sft.template "
                         "(e.g. qwen, qwen3, smollm2) or model.template")
    return template


def preflight(cfg: SFTSection) -> None:
    """Fail before any work on what would only fail minutes later inside LLaMA-Factory."""
    import importlib.util

    if cfg.deepspeed:
        path = Path(lf_config.resolve_project_path(cfg.deepspeed))
        if not path.is_file():
            raise MissingInputError(f"sft.deepspeed={cfg.deepspeed!r}: {path} does not exist; ship one under "
                                    "configs/deepspeed/ (ds_z3.json, ds_z3_offload.json) or unset it")
        if importlib.util.find_spec("deepspeed") is None:
            raise ModuleNotFoundError("sft.deepspeed is set but the deepspeed package is not installed; on the GPU "
                                      "machine run ./scripts/setup-gpu.sh (it installs deepspeed==0.19.8 into "
                                      ".venv) or unset sft.deepspeed")
    if cfg.launcher == "torchrun" and not (Path(bin_dir()) / "torchrun").exists():
        raise MissingInputError(f"sft.launcher=torchrun but {Path(bin_dir()) / 'torchrun'} is missing; "
                                "install torch into this environment or set sft.launcher=python")


def run_sft(cfg: SFTSection, agent: AgentSection, model: ModelRef, data: DatasetRef | None, output_root: str,
            cache_root: str, force: bool = False) -> CheckpointRef:
    """Cold-start SFT of `model`; returns the trained HF folder (the input model when sft.enabled is false)."""
    if not cfg.enabled:
        return passthrough(model, "sft.enabled is false")
    out = stage_dir(output_root, "sft", sft_key(cfg, agent, model, data), force=force)
    if out.complete:
        log.info("sft: cached result in %s", out.path)
        return checkpoint_ref(out, model)
    with tracking.stage_run("sft", out.path) as run:  # LLaMA-Factory logs the loss into it (report_to)
        metrics = compute_sft(cfg, agent, model, data, out, cache_root, run.handoff())
        run.log_summary({f"summary/{k}": v for k, v in tracking.numeric(metrics).items()})
    return checkpoint_ref(out, model)


def compute_sft(cfg: SFTSection, agent: AgentSection, model: ModelRef, data: DatasetRef | None, out: StageDir,
                cache_root: str, report: tracking.Handoff) -> dict[str, Any]:
    """Dataset, LLaMA-Factory training (its logger: `report`), the HF folder; finishes `out`; returns the metrics."""
    template = template_of(cfg, model)
    preflight(cfg)
    counts = prepare_sft_dataset(cfg, agent, data, out.path / "dataset", cache_root)
    trainer = out.path / "trainer"
    model_dir = out.path / "model"
    if not model_dir.is_dir():
        env = subprocess_env()
        tokenized = pretokenize_if_masked(cfg, model, template, out.path, env)
        if not (trainer / "all_results.json").is_file():
            train(cfg, model, template, out.path, tokenized, env, report)
        finalize_model(cfg, model, template, out.path, env)
    check_hf_folder(model_dir, model)
    metrics = collect_metrics(out.path, counts)
    if not cfg.keep_checkpoints:
        for old in trainer.glob("checkpoint-*"):
            shutil.rmtree(old, ignore_errors=True)
    out.finish(content=model_dir, metrics=metrics, template=template)
    return metrics


def checkpoint_ref(out: StageDir, model: ModelRef) -> CheckpointRef:
    marker = out.marker()
    loss_png = out.path / "loss.png"
    return CheckpointRef(path=str(out.path / "model"), fingerprint=marker["fingerprint"], format="hf", base=model,
                         step=marker.get("metrics", {}).get("global_step"),
                         meta={"template": marker.get("template", model.template), "metrics": marker.get("metrics", {}),
                               "loss_png": str(loss_png) if loss_png.is_file() else None, "stage_dir": str(out.path)})


def pretokenize_if_masked(cfg: SFTSection, model: ModelRef, template: str, folder: Path,
                          env: dict[str, str]) -> str | None:
    """With sft.mask_tool_results: LLaMA-Factory tokenization + result masking, in a subprocess."""
    if not cfg.mask_tool_results:
        return None
    tokenized = folder / "tokenized"
    if not (tokenized.is_dir() and (folder / STATS_FILE).is_file()):
        args = lf_config.sft_train_args(cfg, model_path=local_path(model.path), template=template,
                                        dataset_dir=str(folder / "dataset"), dataset=DATASET_NAME,
                                        output_dir=str(folder / "trainer"))
        yaml_path = folder / "pretokenize.yaml"
        write_yaml(yaml_path, args)
        run_streaming([sys.executable, "-m", "stages.sft.masking", str(yaml_path), str(tokenized)],
                      folder / "pretokenize.log", cwd=PROJECT_ROOT, env=env, what="sft-mask")
    return str(tokenized)


def train(cfg: SFTSection, model: ModelRef, template: str, folder: Path, tokenized: str | None,
          env: dict[str, str], report: tracking.Handoff | None = None) -> None:
    """LLaMA-Factory's training run, reporting its loss to the stage's tracker run (`report`: report_to, the run's
    name, the environment that points its logger at that run)."""
    report = report or tracking.Handoff()
    trainer = folder / "trainer"
    resume = resume_point(trainer)
    if resume is not None:
        log.info("sft: resuming from %s", resume)
    if tokenized and not Path(tokenized).is_dir():
        raise FileNotFoundError(f"pre-tokenized dataset {tokenized} is missing; rerun with force=True")
    args = lf_config.sft_train_args(cfg, model_path=local_path(model.path), template=template,
                                    dataset_dir=str(folder / "dataset"),
                                    dataset=DATASET_NAME, output_dir=str(trainer), tokenized_path=tokenized,
                                    resume_from=str(resume) if resume else None, report_to=report.report_to,
                                    run_name=report.name or None)
    env = {**env, **report.env}
    cmd = lf_config.train_command(cfg.launcher, cfg.nproc_per_node, str(folder / "train.yaml"), bin_dir(), env)
    run_config(args, folder / "train.yaml", cmd, folder / "train.log", env, "sft")


def finalize_model(cfg: SFTSection, model: ModelRef, template: str, folder: Path, env: dict[str, str]) -> None:
    """Full FT: move the HF files out of the trainer folder. LoRA: merge with `llamafactory-cli export`."""
    trainer, model_dir = folder / "trainer", folder / "model"
    if cfg.finetuning_type == "lora":
        merge_lora(local_path(model.path), str(trainer), template, model_dir, cfg.bf16, folder, env)
        return
    files = [p for p in trainer.iterdir() if p.is_file() and _HF_FILES.match(p.name)]
    if not any(p.suffix == ".safetensors" for p in files):
        raise FileNotFoundError(f"LLaMA-Factory left no *.safetensors in {trainer}; see {folder / 'train.log'}")
    with atomic_path(model_dir) as tmp:
        tmp.mkdir()
        for path in files:
            shutil.copy2(path, tmp / path.name)
    for path in files:
        path.unlink()


def merge_lora(base_path: str, adapter: str, template: str, model_dir: Path, bf16: bool, folder: Path,
               env: dict[str, str]) -> None:
    import torch

    device = "auto" if torch.cuda.is_available() else "cpu"
    with atomic_path(model_dir) as tmp:
        args = lf_config.export_args(model_path=base_path, adapter_path=adapter, template=template,
                                     export_dir=str(tmp), bf16=bf16, device=device)
        yaml_path = folder / "export.yaml"
        run_config(args, yaml_path, lf_config.export_command(str(yaml_path), bin_dir()), folder / "export.log",
                   env, "lora-merge")
        (tmp / "Modelfile").unlink(missing_ok=True)  # an ollama file LLaMA-Factory writes beside the weights


def check_hf_folder(model_dir: Path, base: ModelRef) -> None:
    """The handed-on folder has a config, weights and the base model's eos token (`<|im_end|>` for ChatML)."""
    from transformers import AutoTokenizer

    if not (model_dir / "config.json").is_file() or not any(model_dir.glob("*.safetensors")):
        raise FileNotFoundError(f"{model_dir} is not a complete HF folder (config.json + *.safetensors)")
    eos = AutoTokenizer.from_pretrained(str(model_dir)).eos_token
    base_eos = AutoTokenizer.from_pretrained(base.path).eos_token
    if eos != base_eos:
        raise ValueError(f"SFT changed the eos token from {base_eos!r} to {eos!r} in {model_dir}; generation would "
                         "not stop. Check the LLaMA-Factory template (sft.template) for this model")


def collect_metrics(folder: Path, counts: dict[str, Any]) -> dict[str, Any]:
    trainer = folder / "trainer"
    metrics: dict[str, Any] = {k: v for k, v in training_metrics(trainer).items() if v is not None}
    metrics |= {f"data_{k}": v for k, v in counts.items() if isinstance(v, (int, float))}
    stats = folder / STATS_FILE
    if stats.is_file():
        metrics |= {f"mask_{k}": v for k, v in json.loads(stats.read_text()).items()}
    state = trainer / "trainer_state.json"
    if state.is_file():
        metrics["global_step"] = json.loads(state.read_text()).get("global_step")
    png = trainer / "training_loss.png"
    if png.is_file():
        shutil.copy2(png, folder / "loss.png")
    write_json(folder / "metrics.json", metrics)
    return metrics
