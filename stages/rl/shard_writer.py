"""Writing a model's weights as safetensors shards while the tensors are still being produced.

The folder has the layout `save_pretrained` writes (what transformers and vLLM load): one `model.safetensors`,
or `model-0000i-of-0000n.safetensors` files plus `model.safetensors.index.json` (`metadata.total_size` in bytes,
`metadata.total_parameters`, `weight_map` name -> file). The shard plan is made up front from the tensors' shapes,
so the file names (which carry the count) are known before the first tensor exists; then each shard's tensors are
taken from an iterator, written with safetensors' `save_file`, and dropped: host memory holds one shard, never the
model.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from stages.core.atomic import write_json

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Tensor names grouped into shards, in the given order: a shard is closed when the next tensor would take it
    past `max_bytes`; a tensor larger than `max_bytes` gets a shard of its own (as save_pretrained does)."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    plan: list[list[str]] = []
    used = 0
    for name, size in sizes.items():
        if not plan or (used + size > max_bytes and plan[-1]):
            plan.append([])
            used = 0
        plan[-1].append(name)
        used += size
    return plan


def shard_file_names(count: int) -> list[str]:
    """save_pretrained's names: one file needs no index; n files are numbered from 1 with the count."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def index_of(plan: list[list[str]], sizes: dict[str, int], numels: dict[str, int]) -> dict:
    """The `model.safetensors.index.json` content for `plan` (weight_map sorted by name, as transformers writes)."""
    files = shard_file_names(len(plan))
    weight_map = {name: file for names, file in zip(plan, files) for name in names}
    return {"metadata": {"total_size": sum(sizes[n] for n in weight_map),
                         "total_parameters": sum(numels[n] for n in weight_map)},
            "weight_map": dict(sorted(weight_map.items()))}


def write_shards(tensors: Iterable[tuple[str, torch.Tensor]], plan: list[list[str]], folder: Path,
                 numels: dict[str, int] | None = None) -> dict | None:
    """Write the (name, tensor) stream, which must come in plan order, as the plan's shard files in `folder`.

    Returns the index written for several shards (None for one file). `numels` (element counts) feeds the index's
    `total_parameters`; without it the counts are taken from the tensors as they pass. Raises ValueError when the
    stream is out of order, short or too long: a folder missing a tensor must never look finished.
    """
    from safetensors.torch import save_file

    if not plan:
        raise ValueError("the shard plan is empty: there are no tensors to write")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stream = iter(tensors)
    sizes: dict[str, int] = {}
    counts: dict[str, int] = dict(numels or {})
    for names, file in zip(plan, shard_file_names(len(plan))):
        shard = {}
        for expected in names:
            item = next(stream, None)
            if item is None:
                raise ValueError(f"the tensor stream ended before {expected!r} ({file}); the shards are incomplete")
            name, tensor = item
            if name != expected:
                raise ValueError(f"tensor {name!r} came where the shard plan has {expected!r} ({file})")
            shard[name] = tensor.contiguous()
            sizes[name] = tensor.numel() * tensor.element_size()
            counts.setdefault(name, tensor.numel())
        # metadata format=pt: transformers refuses a shard without it (or with another framework's)
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        del shard  # the shard's tensors go before the next one is assembled: the memory bound of the writer
    extra = next(stream, None)
    if extra is not None:
        raise ValueError(f"tensor {extra[0]!r} is not in the shard plan; the plan and the stream disagree")
    if len(plan) == 1:
        return None
    index = index_of(plan, sizes, counts)
    write_json(folder / INDEX_FILE, index)
    return index


@contextmanager
def partial_folder(target: Path) -> Iterator[Path]:
    """Build a folder under `<target>.partial` and rename it to `target` when the block succeeds.

    The fixed name (not a random one) lets a run after a crash or a kill find and empty what the dead run left, so
    a half-written model (tens of GB at 14B) never piles up; a failing block removes its own partial folder. A
    reader sees either no `target` or a complete one.
    """
    target = Path(target)
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():
        shutil.rmtree(target)
    tmp.replace(target)
