"""Trainer checkpoints: written atomically, found again after a crash.

    <stage_dir>/checkpoints/step_000004/
        model/            HF folder (safetensors + config + generation config + tokenizer)
        optimizer.pt      AdamW state
        rng.pt            python / numpy / torch (CPU + CUDA) generator states
        state.json        step, epoch, data position, the step's metrics row, config hash (written last)

The folder is assembled under a temporary name and renamed into place in one `os.replace`, so a folder named
`step_*` is always complete; a crash mid-save leaves only a `.step_*.tmp-*` folder, which is ignored and cleaned.
"""

from __future__ import annotations

import random
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stages.core.atomic import atomic_path, write_json
from stages.core.log import get_logger

log = get_logger(__name__)
_STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "state.json"


@dataclass
class TrainerState:
    step: int                      # optimizer steps completed (RL steps, one batch of prompts each)
    epoch: int                     # epoch of the next batch
    position: int                  # index of the next batch within its epoch
    config_hash: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)  # the metrics row of `step`


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def save_checkpoint(root: Path, state: TrainerState, model: torch.nn.Module, tokenizer: Any,
                    optimizer: torch.optim.Optimizer | None, keep: int = 1) -> Path:
    """Write checkpoint `state.step` atomically, then delete all but the newest `keep` complete ones."""
    target = Path(root) / step_dir_name(state.step)
    with atomic_path(target) as tmp:
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp / "model", safe_serialization=True)
        tokenizer.save_pretrained(tmp / "model")
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        write_json(tmp / STATE_FILE, asdict(state))
    prune_checkpoints(root, keep)
    return target


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (those with a state.json), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def prune_checkpoints(root: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints; remove older ones and leftovers of interrupted saves."""
    root = Path(root)
    for _, path in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(path, ignore_errors=True)
    for leftover in root.glob(".step_*.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def read_state(checkpoint: Path) -> TrainerState:
    import json

    data = json.loads((Path(checkpoint) / STATE_FILE).read_text())
    return TrainerState(**data)


def load_training_state(checkpoint: Path, optimizer: torch.optim.Optimizer | None) -> TrainerState:
    """Restore optimizer and RNG states from a checkpoint (the model weights are loaded from checkpoint/model)."""
    checkpoint = Path(checkpoint)
    if optimizer is not None:
        opt_file = checkpoint / "optimizer.pt"
        if not opt_file.is_file():
            raise FileNotFoundError(f"checkpoint {checkpoint} has no optimizer.pt; it was not written by this "
                                    "trainer. Delete the folder to start that run over")
        optimizer.load_state_dict(torch.load(opt_file, map_location="cpu", weights_only=True))
    set_rng_state(torch.load(checkpoint / "rng.pt", weights_only=False))
    state = read_state(checkpoint)
    log.info("resuming from %s (step %d)", checkpoint, state.step)
    return state
