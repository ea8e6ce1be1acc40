"""verl FSDP checkpoint -> HF folder (docs/reference.md "Checkpoint merge"), for policies trained with verl at scale.

verl writes `global_step_<k>/actor/model_world_size_<W>_rank_<r>.pt`: each rank's state dict, whose values are
DTensors carrying their device mesh and placements (plus `actor/huggingface/` with config and tokenizer).
Assembly per key, over the mesh dimensions in order: `Replicate()` takes coordinate 0, `Shard(d)` concatenates the
coordinates' pieces along tensor dim d (uneven last shards are fine), so `(fsdp,)`, `(ddp, fsdp)` and nested
shardings all work; `Partial` placements (unreduced sums) are refused. Plain tensors are taken as sharded along
dim 0 over all W ranks (what verl assumes for non-DTensor state dicts). FSDP1's ShardedTensor is refused by name
(verl's FSDP1 path saves DTensors too; a ShardedTensor cannot even be unpickled without its process group).

Streamed, so that host memory holds one output shard, never the model (a 14B float32 state is 56 GB): the rank
files are opened with `torch.load(mmap=True)` (only the pickled metadata is read), names and shapes are checked
against the model the config builds on the meta device, then tensor by tensor the pieces are assembled, cast and
handed to `shard_writer`, which writes one safetensors shard at a time. Pages of a mapped file that were read
count in the process's resident set while the mapping lives, so the rank files are re-opened after every
`GROUP_BYTES` of assembled data. Architectures whose checkpoint names transformers converts at save time (fused MoE
experts: a conversion mapping) go through `write_in_memory`, the earlier path (everything loaded, `save_pretrained`).
"""

from __future__ import annotations

import inspect
import logging
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stages.core.log import get_logger
from stages.rl.shard_writer import partial_folder, plan_shards, write_shards

log = get_logger(__name__)
_SHARD = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "module.")
MAX_SHARD_BYTES = 2 * 2**30  # one output shard is held in memory while it is written
GROUP_BYTES = 2**30  # assembled source bytes between re-opening the mapped rank files


@dataclass(frozen=True)
class Entry:
    """One tensor of the checkpoint: its key in the rank files, its HF name, global shape and stored dtype."""

    key: str
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of the full tensor, stored or cast to `dtype` (only floating tensors are cast)."""
        out = dtype if dtype is not None and self.dtype.is_floating_point else self.dtype
        return self.numel * torch.empty((), dtype=out).element_size()


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


@contextmanager
def _quiet_mesh_unpickling() -> Iterator[None]:
    """Unpickling a DeviceMesh without process groups logs a torch.compile warning per file; we never compile, and
    the streamed merge re-opens the files many times."""
    logger = logging.getLogger("torch.distributed.device_mesh")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def load_rank_state(path: Path) -> tuple[dict[str, Any], bool]:
    """One rank's state dict and whether it is memory-mapped (torch >= 2.1 and the zip format written since 1.6):
    mapped, a tensor's bytes are read only when it is used. Older torch or a legacy file: a full load, and the
    merge then holds that rank's whole file in memory."""
    params = inspect.signature(torch.load).parameters
    kwargs: dict[str, Any] = {"map_location": "cpu"}
    if "weights_only" in params:  # our own run's files; DTensor / DeviceMesh are not allowlisted in every torch
        kwargs["weights_only"] = False
    with _quiet_mesh_unpickling():
        if "mmap" in params:
            try:
                return torch.load(path, mmap=True, **kwargs), True
            except RuntimeError as err:  # "mmap can only be used with files saved with ... zipfile ..."
                if "mmap" not in str(err):
                    raise
                log.warning("%s cannot be memory-mapped (%s); loading it whole", path, err)
        return torch.load(path, **kwargs), False


def _dtensor_api() -> tuple[type, type, type]:
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard  # public since torch 2.4
    except ImportError:  # torch 2.1-2.3
        from torch.distributed._tensor import DTensor, Replicate, Shard
    return DTensor, Replicate, Shard


def _refuse_sharded_tensor(value: Any, key: str) -> None:
    if type(value).__name__ == "ShardedTensor":
        raise ValueError(f"{key} is an FSDP1 ShardedTensor (SHARDED_STATE_DICT without DTensor); this merge reads "
                         "DTensor (FSDP2, what the verl mapping configures) or plain tensors. Re-save the "
                         "checkpoint with actor strategy fsdp2, or merge it with verl.model_merger")


def _assemble(pieces: list[Any], key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The full tensor from its per-rank pieces; with `dtype`, floating pieces are cast before they are joined
    (the same values as casting the result, without a full-size copy in the stored dtype)."""
    DTensor, Replicate, Shard = _dtensor_api()
    first = pieces[0]
    _refuse_sharded_tensor(first, key)

    def leaf(piece: torch.Tensor) -> torch.Tensor:
        piece = piece.detach().cpu()
        return piece.to(dtype) if dtype is not None and piece.is_floating_point() else piece

    if not isinstance(first, DTensor):
        return torch.cat([leaf(p) for p in pieces], dim=0) if first.dim() > 0 else leaf(first)
    mesh_ranks = first.device_mesh.mesh  # tensor of global ranks, one axis per mesh dimension
    placements = first.placements

    def build(dim: int, index: tuple[int, ...]) -> torch.Tensor:
        if dim == mesh_ranks.dim():
            return leaf(pieces[int(mesh_ranks[index])].to_local())
        placement = placements[dim]
        if isinstance(placement, Replicate):
            return build(dim + 1, index + (0,))
        if isinstance(placement, Shard):
            return torch.cat([build(dim + 1, index + (i,)) for i in range(mesh_ranks.shape[dim])], dim=placement.dim)
        raise ValueError(f"{key}: placement {placement} on mesh dim {dim} cannot be merged (only Shard/Replicate)")

    return build(0, ())


def hf_name(key: str) -> str:
    """The model's parameter name for a rank-file key (FSDP / checkpoint / DDP wrapper prefixes removed)."""
    for prefix in _PREFIXES:
        key = key.replace(prefix, "")
    return key


def _same_keys(states: list[dict[str, Any]]) -> list[str]:
    keys = list(states[0])
    for rank, state in enumerate(states[1:], start=1):
        if list(state) != keys:
            raise ValueError(f"rank {rank}'s shard has other keys than rank 0's; the shards are from different runs")
    return keys


def merge_state_dicts(states: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """One full state dict from the per-rank state dicts (list index = global rank): the reference assembly,
    everything in memory at once."""
    return {hf_name(key): _assemble([s[key] for s in states], key) for key in _same_keys(states)}


def read_layout(states: list[dict[str, Any]]) -> list[Entry]:
    """Every tensor's name, global shape and dtype, from the metadata alone (no tensor data is read)."""
    DTensor = _dtensor_api()[0]
    entries, seen = [], {}
    for key in _same_keys(states):
        pieces = [s[key] for s in states]
        first = pieces[0]
        _refuse_sharded_tensor(first, key)
        if isinstance(first, DTensor):
            shape = tuple(first.shape)  # a DTensor's shape is the global one
        elif first.dim() == 0:
            shape = ()
        else:
            shape = (sum(p.shape[0] for p in pieces), *first.shape[1:])
        name = hf_name(key)
        if name in seen:
            raise ValueError(f"keys {seen[name]!r} and {key!r} both name {name!r} once the wrapper prefixes go")
        seen[name] = key
        entries.append(Entry(key, name, shape, first.dtype))
    return entries


def _owned(tensor: torch.Tensor, pieces: list[Any]) -> torch.Tensor:
    """A copy when `tensor` still is a rank file's mapped bytes (a Replicate or 0-d piece, not cast): holding such
    a view would keep the whole mapping, and what was read of it, alive past the re-open."""
    ptr = tensor.untyped_storage().data_ptr()
    locals_ = [p.to_local() if hasattr(p, "to_local") else p for p in pieces]
    return tensor.clone() if any(t.untyped_storage().data_ptr() == ptr for t in locals_) else tensor


def _assembled(states: list[dict[str, Any]], entry: Entry, dtype: torch.dtype | None) -> torch.Tensor:
    pieces = [s[entry.key] for s in states]
    full = _assemble(pieces, entry.key, dtype)
    if tuple(full.shape) != entry.shape:
        raise ValueError(f"{entry.key}: assembled shape {tuple(full.shape)} differs from the checkpoint's global "
                         f"shape {entry.shape}; the rank files disagree")
    return _owned(full, pieces)


def _open_ranks(shards: list[Path]) -> tuple[list[dict[str, Any]], bool]:
    loaded = [load_rank_state(p) for p in shards]
    return [state for state, _ in loaded], all(mapped for _, mapped in loaded)


def stream_assembled(shards: list[Path], entries: list[Entry], dtype: torch.dtype | None = None,
                     group_bytes: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor cast to `dtype`) for each entry in order, reading only what each tensor needs.

    Mapped rank files are re-opened after every `group_bytes` of assembled source data (GROUP_BYTES by default),
    which unmaps what was read; files that could not be mapped are loaded once and kept.
    """
    group_bytes = group_bytes or GROUP_BYTES
    states: list[dict[str, Any]] | None = None
    mapped, read = False, 0
    for entry in entries:
        if states is None:
            states, mapped = _open_ranks(shards)
            read = 0
        tensor = _assembled(states, entry, dtype)
        read += entry.nbytes()
        if mapped and read >= group_bytes:
            states = None  # unmapped before the consumer works on the tensor; the next entry re-opens the files
        yield entry.name, tensor
        del tensor


def meta_model(config: Any) -> torch.nn.Module:
    """The architecture `config` names, with no memory behind its weights (names, shapes, ties only)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def tied_names(model: torch.nn.Module) -> set[str]:
    """Names of parameters that are another, earlier name's parameter (lm_head tied to the embedding):
    save_pretrained leaves them out of the files and the loader ties them again."""
    first: dict[int, str] = {}
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied.add(name)
        else:
            first[id(param)] = name
    return tied


def check_layout(entries: list[Entry], model: torch.nn.Module) -> set[str]:
    """Raise naming what does not fit `model` (missing / unexpected names, wrong shapes); return the tied names
    present in the checkpoint, which the folder leaves out."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tied = tied_names(model)
    names = {e.name: e.shape for e in entries}
    missing, unexpected = sorted(set(expected) - set(names) - tied), sorted(set(names) - set(expected))
    if missing or unexpected:
        raise ValueError(f"the merged state dict does not fit {type(model).__name__}: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}; is config.json the one the run trained?")
    wrong = [f"{n} {s} vs {expected[n]}" for n, s in names.items() if s != expected[n]]
    if wrong:
        raise ValueError(f"assembled shapes differ from the model's ({len(wrong)}): {wrong[:3]}; the shards' "
                         "placements or the config do not match the run")
    return tied & set(names)


def has_weight_conversion(model: torch.nn.Module) -> bool:
    """Whether transformers renames or fuses this architecture's weights between checkpoint and module."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # transformers 4: checkpoint names are module names
        return False
    return bool(get_model_conversion_mapping(model, add_legacy=False))


def write_merged_folder(actor_dir: str | Path, folder: str | Path, config_dir: str | Path | None = None,
                        dtype: torch.dtype | None = None, max_shard_bytes: int | None = None,
                        in_memory: bool | None = None) -> list[Entry]:
    """Write the HF folder for a verl actor checkpoint into `folder` (not atomic: callers use `partial_folder`).

    `dtype` (floating tensors only) defaults to the stored one; `in_memory` None picks the streamed writer unless
    the architecture needs transformers' save-time conversion. Returns the entries written, in order.
    """
    from transformers import AutoConfig

    actor_dir, folder = Path(actor_dir), Path(folder)
    config_dir = Path(config_dir) if config_dir else actor_dir / "huggingface"
    if not (config_dir / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {config_dir}; pass config_dir= the base model folder")
    shards = find_shards(actor_dir)
    config = AutoConfig.from_pretrained(config_dir)
    entries = read_layout([load_rank_state(p)[0] for p in shards])
    if not entries:
        raise ValueError(f"{shards[0]} holds no tensors; the checkpoint was not written completely")
    dtype = dtype or entries[0].dtype
    model = meta_model(config)
    kept = [e for e in entries if e.name not in check_layout(entries, model)]
    if in_memory is None:
        in_memory = has_weight_conversion(model)
        if in_memory:
            log.warning("%s weights are converted by transformers at save time: merging in memory (several "
                        "copies of the model)", config.model_type)
    log.info("merging %d FSDP shards from %s (%s)", len(shards), actor_dir, "in memory" if in_memory else "streamed")
    if in_memory:
        write_in_memory(shards, folder, config, dtype)
    else:
        sizes = {e.name: e.nbytes(dtype) for e in kept}
        write_shards(stream_assembled(shards, kept, dtype), plan_shards(sizes, max_shard_bytes or MAX_SHARD_BYTES),
                     folder, numels={e.name: e.numel for e in kept})
        config.architectures = [type(model).__name__]
        config.dtype = dtype  # what save_pretrained records: the dtype of the weights in the files
        config.save_pretrained(folder)
    _write_side_files(config_dir, folder, config)
    return kept


def write_in_memory(shards: list[Path], folder: Path, config: Any, dtype: torch.dtype) -> None:
    """The earlier path: all ranks loaded, one full state dict, a model, `save_pretrained` (several model copies in
    memory). Kept for architectures whose save needs transformers' weight conversion, and as the reference."""
    from transformers import AutoModelForCausalLM

    state = merge_state_dicts([torch.load(p, map_location="cpu", weights_only=False) for p in shards])
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(state, strict=False)  # names were checked by check_layout
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model.save_pretrained(folder, safe_serialization=True)


def _write_side_files(config_dir: Path, folder: Path, config: Any) -> None:
    """Tokenizer and generation config: the run's own files when it has them (as save_pretrained's defaults
    would otherwise be derived from config.json)."""
    from transformers import AutoTokenizer, GenerationConfig

    if any((config_dir / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        AutoTokenizer.from_pretrained(config_dir).save_pretrained(folder)
    if (config_dir / "generation_config.json").is_file():
        shutil.copyfile(config_dir / "generation_config.json", folder / "generation_config.json")
    elif not (folder / "generation_config.json").is_file():
        GenerationConfig.from_model_config(config).save_pretrained(folder)


def merge_fsdp_shards(actor_dir: str | Path, out_dir: str | Path, config_dir: str | Path | None = None,
                      dtype: torch.dtype | None = None, max_shard_bytes: int | None = None) -> Path:
    """Write an HF folder for a verl actor checkpoint, atomically. `config_dir` defaults to
    `<actor_dir>/huggingface`."""
    with partial_folder(Path(out_dir)) as tmp:
        write_merged_folder(actor_dir, tmp, config_dir, dtype, max_shard_bytes)
    return Path(out_dir)
