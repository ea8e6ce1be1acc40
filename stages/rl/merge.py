"""The merge stage: a trained checkpoint -> a plain Hugging Face safetensors folder, checked by a parity probe.

Inputs by `CheckpointRef.format`:
- trainer: our RL trainer's final checkpoint (`model/` HF folder + `probe.json` with the log-probs the trainer's
  in-memory model gave on fixed probe sequences);
- lora: a PEFT adapter over `ckpt.base`, merged with peft's merge_and_unload (the reference log-probs come from
  the unmerged adapter model);
- hf: an HF folder (re-saved in `cfg.dtype`; the reference log-probs come from the source folder).
The merged folder gets the weights in `cfg.dtype`, the tokenizer and the generation config. It is then loaded
back from disk and its log-probs on the probe sequences must match the reference within `cfg.parity_atol`,
else `MergeParityError` reports the largest difference and the stage stays incomplete. The weights and the probe
are stages/rl/merge_weights.py, imported when a merge runs (a cached run computes this key without torch).

- verl_fsdp: a verl FSDP actor folder (`global_step_<N>/actor`, the verl engine's output): its shards are streamed
  straight into the merged folder in `cfg.dtype` by `stages.rl.fsdp_merge.write_merged_folder` (one output shard in
  memory, no float32 copy on disk); the reference log-probs come from the assembled float32 weights, and the
  folder's tensors are also checked bit for bit against the assembled ones rounded.
"""

from __future__ import annotations

from pathlib import Path

from stages.core.atomic import write_json
from stages.core.codeversion import code_version
from stages.core.config.merge import MergeSection
from stages.core.fingerprint import hash_value
from stages.core.refs import CheckpointRef, ModelRef
from stages.core.workspace import stage_dir


def merge_key(cfg: MergeSection, ckpt: CheckpointRef) -> str:
    """The stage's one key (its folder name and its Prefect cache key)."""
    return hash_value(cfg, ckpt.fingerprint, code_version(__name__))


def merge_checkpoint(cfg: MergeSection, ckpt: CheckpointRef, output_root: str | Path,
                     force: bool = False) -> ModelRef:
    out = stage_dir(output_root, "merge", merge_key(cfg, ckpt), force=force)
    model_dir = out.path / "model"
    if not out.complete:
        from stages.rl.merge_weights import merge_to_folder  # torch and the model code: only when merging

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
