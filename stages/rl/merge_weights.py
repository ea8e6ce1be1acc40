"""The merge stage's work (stages/rl/merge.py is its entry and key): a checkpoint's weights into one safetensors
folder and the parity probe that checks it (what each input format goes through: stages/rl/merge.py). Kept apart
from the entry module so computing the merge key imports no torch.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from stages.core.config.merge import MergeSection
from stages.core.log import get_logger
from stages.core.refs import CheckpointRef
from stages.generation.models import load_policy, load_tokenizer, policy_folder
from stages.rl.fsdp_merge import find_shards, stream_assembled, write_merged_folder
from stages.rl.modeling import DTYPES, pick_device
from stages.rl.probe import max_abs_diff, probe_logprobs, probe_sequences, read_probe
from stages.rl.shard_writer import partial_folder

log = get_logger(__name__)


class MergeParityError(RuntimeError):
    """The merged model's log-probs differ from the trained model's beyond the allowed tolerance."""


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
    """Write the merged folder (atomically: built under `<model_dir>.partial`, which a failure removes) after the
    parity checks; returns the report."""
    with partial_folder(model_dir) as tmp:
        merge = _merge_verl if ckpt.format == "verl_fsdp" else _merge_loaded
        report = merge(cfg, ckpt, tmp)
    log.info("merged %s checkpoint %s -> %s (%s; parity max |dlogp|: load %.2e, merge %.2e <= %.1e; %s rounding "
             "moves log-probs by up to %.2e)", ckpt.format, ckpt.path, model_dir, cfg.dtype, report["load_diff"],
             report["merge_diff"], cfg.parity_atol, cfg.dtype, report["dtype_rounding_diff"])
    return {"model_dir": str(model_dir), "max_abs_diff": max(report["load_diff"], report["merge_diff"]), **report,
            "parity_atol": cfg.parity_atol, "dtype": cfg.dtype, "format": ckpt.format}


def _merge_loaded(cfg: MergeSection, ckpt: CheckpointRef, tmp: Path) -> dict:
    """trainer / lora / hf: two checks.

    1. the loaded (for LoRA: merged) float32 weights reproduce the trained model's probe log-probs;
    2. the folder written in `cfg.dtype` and loaded back from disk reproduces the same weights rounded to
       `cfg.dtype` (so the tolerance is about the merge, not about the rounding, which is reported).
    """
    tokenizer = load_tokenizer(ckpt)
    sequences, trained, device = reference_probe(ckpt, tokenizer)
    model = load_policy(ckpt, torch.float32, merge_lora=True).to(device)
    loaded = require_parity(trained, probe_logprobs(model, sequences), cfg.parity_atol,
                            f"the {ckpt.format} checkpoint {ckpt.path} loaded in float32")
    dtype = DTYPES[cfg.dtype]
    round_weights(model, dtype)
    rounded = probe_logprobs(model, sequences)
    model = model.to(dtype).cpu()
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    _copy_generation_config(ckpt, tmp)
    del model
    merged = require_parity(rounded, reload_probe(tmp, sequences, device), cfg.parity_atol,
                            f"the merged {cfg.dtype} folder {tmp} loaded back from disk")
    return {"load_diff": loaded, "merge_diff": merged, "dtype_rounding_diff": max_abs_diff(trained, rounded),
            "probe_tokens": sum(len(s) - 1 for s in sequences)}


def _merge_verl(cfg: MergeSection, ckpt: CheckpointRef, tmp: Path) -> dict:
    """verl FSDP shards, streamed into `tmp` in `cfg.dtype` (no float32 folder in between); then one float32 model,
    the folder loaded back from disk, is the whole memory of the checks.

    verl writes no probe, so the assembled float32 weights are the reference and check 1 holds by definition
    (`load_diff` 0). Check 2 is the same as for the other formats: the folder loaded back reproduces the assembled
    weights rounded to `cfg.dtype`, within `cfg.parity_atol` on the probe, and here also bit for bit, tensor by
    tensor (`put_assembled_weights`).
    """
    dtype = DTYPES[cfg.dtype]
    entries = write_merged_folder(ckpt.path, tmp, dtype=dtype)
    written = CheckpointRef(path=str(tmp), fingerprint=ckpt.fingerprint, format="hf", base=ckpt.base, step=ckpt.step)
    tokenizer = load_tokenizer(written)
    tokenizer.save_pretrained(tmp)  # the base's tokenizer when the run's huggingface/ folder has none
    sequences, device = probe_sequences(tokenizer), pick_device()
    # loaded in the folder's own dtype, transformers maps the files rather than copying them; the upcast then goes
    # parameter by parameter, so the peak is the float32 model alone (a float32 load held it and the mapped files)
    model = load_policy(written, dtype).to(device=device, dtype=torch.float32)
    merged = probe_logprobs(model, sequences)
    put_assembled_weights(model, stream_assembled(find_shards(Path(ckpt.path)), entries), dtype)
    trained = probe_logprobs(model, sequences)
    round_weights(model, dtype)
    rounded = probe_logprobs(model, sequences)
    del model
    diff = require_parity(rounded, merged, cfg.parity_atol,
                          f"the merged {cfg.dtype} folder {tmp} loaded back from disk")
    return {"load_diff": 0.0, "merge_diff": diff, "dtype_rounding_diff": max_abs_diff(trained, rounded),
            "probe_tokens": sum(len(s) - 1 for s in sequences), "exact_tensors": len(entries)}


@torch.no_grad()
def put_assembled_weights(model: torch.nn.Module, tensors: Iterator[tuple[str, torch.Tensor]],
                          dtype: torch.dtype) -> None:
    """Check that each of `model`'s tensors (loaded from the merged folder) equals the assembled one rounded to
    `dtype`, bit for bit, then put the unrounded assembled values in its place, one tensor at a time."""
    targets = model.state_dict()
    for name, tensor in tensors:
        if name not in targets:
            raise MergeParityError(f"{name} is in the checkpoint but not in the model loaded from the merged folder")
        target = targets[name]
        diff = _rounded_mismatch(target, tensor, dtype)
        if diff is not None:
            raise MergeParityError(f"{name} in the merged folder differs from the assembled shards rounded to "
                                   f"{dtype} (max |diff| {diff:.3e}); the folder was not written completely or was "
                                   "changed, re-run the merge")
        target.copy_(tensor)


def _rounded_mismatch(stored: torch.Tensor, assembled: torch.Tensor, dtype: torch.dtype,
                      chunk: int = 2**24) -> float | None:
    """None when `stored` (the folder's values, upcast) equals `assembled` rounded to `dtype` bit for bit, else
    the largest difference. Compared in `dtype` (exact: the upcast values came from it), 2^24 elements at a time,
    so the comparison adds chunks, not copies of the largest tensor (the 14B embedding: 3.1 GB in float32)."""
    if stored.shape != assembled.shape:
        return float("inf")
    cast = dtype if assembled.is_floating_point() else assembled.dtype
    flat_stored, flat_assembled = stored.reshape(-1), assembled.reshape(-1)
    for start in range(0, flat_assembled.numel(), chunk):
        a = flat_stored[start:start + chunk].to(device="cpu", dtype=cast)
        b = flat_assembled[start:start + chunk].to(cast)
        if not torch.equal(a, b):
            return float((a.double() - b.double()).abs().max())
    return None


@torch.no_grad()
def round_weights(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Round the parameters to `dtype`, keeping them float32, so probing them measures what the rounding does
    (not buffers such as RoPE frequencies, which are recomputed on load)."""
    for param in model.parameters():
        param.copy_(param.to(dtype).to(torch.float32))


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
