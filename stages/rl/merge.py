"""The merge stage: a trained checkpoint -> a plain Hugging Face safetensors folder, checked by a parity probe.

Inputs by `CheckpointRef.format`:
- trainer: our RL trainer's final checkpoint (`model/` HF folder + `probe.json` with the log-probs the trainer's
  in-memory model gave on fixed probe sequences);
- lora: a PEFT adapter over `ckpt.base`, merged with peft's merge_and_unload (the reference log-probs come from
  the unmerged adapter model);
- hf: an HF folder (re-saved in `cfg.dtype`; the reference log-probs come from the source folder).
The merged folder gets the weights in `cfg.dtype`, the tokenizer and the generation config. It is then loaded
back from disk and its log-probs on the probe sequences must match the reference within `cfg.parity_atol`,
else `MergeParityError` reports the largest difference and the stage stays incomplete.

- verl_fsdp: a verl FSDP actor folder (`global_step_<N>/actor`, the verl engine's output): its shards are first
  assembled into an HF folder by `stages.rl.fsdp_merge.merge_fsdp_shards`, which is then merged as `hf` (the
  reference log-probs come from the assembled float32 weights).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from stages.core.atomic import write_json
from stages.core.codeversion import code_version
from stages.core.config.rl import MergeSection
from stages.core.fingerprint import hash_value
from stages.core.log import get_logger
from stages.core.refs import CheckpointRef, ModelRef
from stages.core.workspace import stage_dir
from stages.generation.models import load_policy, load_tokenizer, policy_folder
from stages.rl.modeling import DTYPES, pick_device
from stages.rl.probe import max_abs_diff, probe_logprobs, probe_sequences, read_probe

log = get_logger(__name__)


class MergeParityError(RuntimeError):
    """The merged model's log-probs differ from the trained model's beyond the allowed tolerance."""


def merge_key(cfg: MergeSection, ckpt: CheckpointRef) -> str:
    """The stage's one key (its folder name and its Prefect cache key)."""
    return hash_value(cfg, ckpt.fingerprint, code_version(__name__))


def merge_checkpoint(cfg: MergeSection, ckpt: CheckpointRef, output_root: str | Path,
                     force: bool = False) -> ModelRef:
    out = stage_dir(output_root, "merge", merge_key(cfg, ckpt), force=force)
    model_dir = out.path / "model"
    if not out.complete:
        report = merge_to_folder(cfg, ckpt, model_dir)
        write_json(out.path / "merge_report.json", report)
        out.finish(**{k: v for k, v in report.items() if k != "model_dir"})
    base = ckpt.base
    return ModelRef(path=str(model_dir), fingerprint=out.fingerprint,
                    name=f"{base.name}-{ckpt.format}-merged" if base else model_dir.name,
                    template=base.template if base else "",
                    meta={"dtype": cfg.dtype, "source": ckpt.path, "source_format": ckpt.format,
                          "step": ckpt.step, **{k: v for k, v in out.marker().items()
                                                if k in ("max_abs_diff", "parity_atol", "probe_tokens")}})


def reference_probe(ckpt: CheckpointRef, tokenizer) -> tuple[list[list[int]], list[list[float]], torch.device]:
    """Probe sequences, the log-probs the merged model must reproduce, and the device to measure on (the one
    the trainer used when it is available here)."""
    if ckpt.format == "trainer":
        probe = read_probe(Path(ckpt.path))
        wanted = probe.get("device", "cpu")
        device = torch.device("cuda" if wanted == "cuda" and torch.cuda.is_available() else "cpu")
        return probe["sequences"], probe["logprobs"], device
    device = pick_device()
    sequences = probe_sequences(tokenizer)
    source = load_policy(ckpt, torch.float32, merge_lora=False).to(device)
    try:
        return sequences, probe_logprobs(source, sequences), device
    finally:
        del source


def merge_to_folder(cfg: MergeSection, ckpt: CheckpointRef, model_dir: Path) -> dict:
    """Write the merged folder (atomically) after two parity checks; returns the report.

    1. the loaded (for LoRA: merged) float32 weights reproduce the trained model's probe log-probs;
    2. the folder written in `cfg.dtype` and loaded back from disk reproduces the same weights rounded to
       `cfg.dtype` (so the tolerance is about the merge, not about the rounding, which is reported).
    """
    assembled = None
    if ckpt.format == "verl_fsdp":
        assembled = model_dir.with_name("verl_assembled")
        ckpt = assembled_verl_checkpoint(ckpt, assembled)
    tokenizer = load_tokenizer(ckpt)
    sequences, trained, device = reference_probe(ckpt, tokenizer)
    model = load_policy(ckpt, torch.float32, merge_lora=True).to(device)
    loaded = require_parity(trained, probe_logprobs(model, sequences), cfg.parity_atol,
                            f"the {ckpt.format} checkpoint {ckpt.path} loaded in float32")
    dtype = DTYPES[cfg.dtype]
    with torch.no_grad():  # round the weights once (not buffers such as RoPE frequencies, which are recomputed
        for param in model.parameters():  # on load); the float32 copy holds exactly the rounded values
            param.copy_(param.to(dtype).to(torch.float32))
    rounded = probe_logprobs(model, sequences)
    model = model.to(dtype).cpu()
    tmp = model_dir.with_name(model_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    _copy_generation_config(ckpt, tmp)
    del model
    merged = require_parity(rounded, reload_probe(tmp, sequences, device), cfg.parity_atol,
                            f"the merged {cfg.dtype} folder {tmp} loaded back from disk")
    if model_dir.exists():
        shutil.rmtree(model_dir)
    tmp.replace(model_dir)
    if assembled is not None:  # a float32 copy of the model (56 GB at 14B); the merged folder replaces it
        shutil.rmtree(assembled, ignore_errors=True)
    rounding = max_abs_diff(trained, rounded)
    log.info("merged %s checkpoint %s -> %s (%s; parity max |dlogp|: load %.2e, merge %.2e <= %.1e; %s rounding "
             "moves log-probs by up to %.2e)", ckpt.format, ckpt.path, model_dir, cfg.dtype, loaded, merged,
             cfg.parity_atol, cfg.dtype, rounding)
    return {"model_dir": str(model_dir), "max_abs_diff": max(loaded, merged), "load_diff": loaded,
            "merge_diff": merged, "dtype_rounding_diff": rounding, "parity_atol": cfg.parity_atol,
            "probe_tokens": sum(len(s) - 1 for s in sequences), "dtype": cfg.dtype, "format": ckpt.format}


def assembled_verl_checkpoint(ckpt: CheckpointRef, folder: Path) -> CheckpointRef:
    """verl's FSDP shards -> a float32 HF folder (config and tokenizer from `<actor>/huggingface`)."""
    from stages.rl.fsdp_merge import merge_fsdp_shards

    merge_fsdp_shards(ckpt.path, folder, dtype=torch.float32)
    return CheckpointRef(path=str(folder), fingerprint=ckpt.fingerprint, format="hf", base=ckpt.base, step=ckpt.step,
                         meta={**ckpt.meta, "assembled_from": ckpt.path})


def _copy_generation_config(ckpt: CheckpointRef, target: Path) -> None:
    """save_pretrained writes the model's generation config; prefer the source's file when it has one."""
    candidates = [policy_folder(ckpt) / "generation_config.json"]
    if ckpt.base is not None:
        candidates.append(Path(ckpt.base.path) / "generation_config.json")
    for source in candidates:
        if source.is_file():
            shutil.copyfile(source, target / "generation_config.json")
            return


def reload_probe(model_dir: Path, sequences: list[list[int]], device: torch.device) -> list[list[float]]:
    """Load `model_dir` from disk (upcast to float32) and measure the probe log-probs on `device`."""
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    try:
        return probe_logprobs(merged.to(device), sequences)
    finally:
        del merged


def require_parity(expected: list[list[float]], actual: list[list[float]], atol: float, what: str) -> float:
    """max |expected - actual|; raises MergeParityError naming `what` when it exceeds `atol` (or is NaN)."""
    diff = max_abs_diff(expected, actual)
    if not diff <= atol:
        raise MergeParityError(
            f"parity probe failed: {what} gives max |logp merged - logp trained| = {diff:.3e} over "
            f"{sum(len(x) for x in expected)} probe tokens, above merge.parity_atol = {atol:.1e}. The weights do not "
            "reproduce the trained model; check the checkpoint (was it written completely?) and the merge inputs")
    return diff
