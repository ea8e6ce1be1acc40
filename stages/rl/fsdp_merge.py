"""verl FSDP checkpoint -> HF folder (docs/reference.md "Checkpoint merge"), for policies trained with verl at scale.

verl writes `global_step_<k>/actor/model_world_size_<W>_rank_<r>.pt`: each rank's state dict, whose values are
DTensors carrying their device mesh and placements (plus `actor/huggingface/` with config and tokenizer).
Assembly per key, over the mesh dimensions in order: `Replicate()` takes coordinate 0, `Shard(d)` concatenates the
coordinates' pieces along tensor dim d (uneven last shards are fine), so `(fsdp,)`, `(ddp, fsdp)` and nested
shardings all work; `Partial` placements (unreduced sums) are refused. Plain tensors are taken as sharded along
dim 0 over all W ranks (what verl assumes for non-DTensor state dicts).

The result is loaded into a model built from the config and saved with `save_pretrained` (safetensors); the
merge stage (`merge.py`) can then treat it as an `hf` checkpoint.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch

from stages.core.log import get_logger

log = get_logger(__name__)
_SHARD = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "module.")


def find_shards(actor_dir: Path) -> list[Path]:
    """The W rank files of an actor folder, in rank order; raises naming what is missing."""
    actor_dir = Path(actor_dir)
    found: dict[int, Path] = {}
    worlds = set()
    for path in actor_dir.glob("model_world_size_*_rank_*.pt"):
        match = _SHARD.match(path.name)
        if match:
            worlds.add(int(match.group(1)))
            found[int(match.group(2))] = path
    if not found:
        raise FileNotFoundError(f"{actor_dir} has no model_world_size_<W>_rank_<r>.pt files; point at the verl "
                                "checkpoint's global_step_<k>/actor folder")
    if len(worlds) != 1:
        raise ValueError(f"{actor_dir} mixes world sizes {sorted(worlds)}; keep the shards of one run only")
    world = worlds.pop()
    missing = sorted(set(range(world)) - set(found))
    if missing:
        raise FileNotFoundError(f"{actor_dir}: world size {world} but ranks {missing} are missing")
    return [found[r] for r in range(world)]


def _assemble(pieces: list[Any], key: str) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    first = pieces[0]
    if not isinstance(first, DTensor):
        return torch.cat([p.detach().cpu() for p in pieces], dim=0) if first.dim() > 0 else first.detach().cpu()
    mesh_ranks = first.device_mesh.mesh  # tensor of global ranks, one axis per mesh dimension
    placements = first.placements

    def build(dim: int, index: tuple[int, ...]) -> torch.Tensor:
        if dim == mesh_ranks.dim():
            return pieces[int(mesh_ranks[index])].to_local().detach().cpu()
        placement = placements[dim]
        if isinstance(placement, Replicate):
            return build(dim + 1, index + (0,))
        if isinstance(placement, Shard):
            return torch.cat([build(dim + 1, index + (i,)) for i in range(mesh_ranks.shape[dim])], dim=placement.dim)
        raise ValueError(f"{key}: placement {placement} on mesh dim {dim} cannot be merged (only Shard/Replicate)")

    return build(0, ())


def merge_state_dicts(states: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """One full state dict from the per-rank state dicts (list index = global rank)."""
    keys = list(states[0])
    for rank, state in enumerate(states[1:], start=1):
        if list(state) != keys:
            raise ValueError(f"rank {rank}'s shard has other keys than rank 0's; the shards are from different runs")
    merged = {}
    for key in keys:
        name = key
        for prefix in _PREFIXES:
            name = name.replace(prefix, "")
        merged[name] = _assemble([s[key] for s in states], key)
    return merged


def merge_fsdp_shards(actor_dir: str | Path, out_dir: str | Path, config_dir: str | Path | None = None,
                      dtype: torch.dtype | None = None) -> Path:
    """Write an HF folder for a verl actor checkpoint. `config_dir` defaults to `<actor_dir>/huggingface`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    actor_dir, out_dir = Path(actor_dir), Path(out_dir)
    config_dir = Path(config_dir) if config_dir else actor_dir / "huggingface"
    if not (config_dir / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {config_dir}; pass config_dir= the base model folder")
    shards = find_shards(actor_dir)
    log.info("merging %d FSDP shards from %s", len(shards), actor_dir)
    state = merge_state_dicts([torch.load(p, map_location="cpu", weights_only=False) for p in shards])
    config = AutoConfig.from_pretrained(config_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype or next(iter(state.values())).dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"the merged state dict does not fit {config.architectures}: missing "
                         f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}")
    if tied:
        model.tie_weights()
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    if any((config_dir / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        AutoTokenizer.from_pretrained(config_dir).save_pretrained(tmp)
    if (config_dir / "generation_config.json").is_file():
        shutil.copyfile(config_dir / "generation_config.json", tmp / "generation_config.json")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.replace(out_dir)
    return out_dir
