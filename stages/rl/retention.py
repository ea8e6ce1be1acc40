"""What a finished (or resumed) RL stage keeps on disk.

A checkpoint is the policy plus its optimizer state; fp32 AdamW holds two moments per parameter, so the optimizer
file is twice the model (0.54 GB model + 1.08 GB optimizer for the 135M tiny model; ~112 GB of optimizer state at
14B). Resuming a crashed run needs it; nothing reads it once the stage is complete (the merge stage reads the model
only, and a new RL config is a new stage key that starts from its policy, not from this optimizer). So:

- `rl.trainer.keep_checkpoints` holds on disk across attempts too: verl deletes older `global_step_*` folders only
  among those its own process saved, so a run resumed after a crash keeps the crashed attempt's folders forever
  unless we prune them (before each attempt and at the end);
- when the stage finishes, the final checkpoint's optimizer state is deleted unless
  `rl.trainer.keep_optimizer_state` is set (continuing the run by hand needs it).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from stages.core.log import get_logger

log = get_logger(__name__)
_VERL_STEP = re.compile(r"^global_step_(\d+)$")
_VERL_OPTIMIZER = "optim_world_size_*_rank_*.pt"   # verl's FSDP checkpoint manager, one file per rank
_TRAINER_OPTIMIZER = "optimizer.pt"                  # stages/rl/checkpoint.py


def prune_verl_checkpoints(checkpoints: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete `global_step_<N>` folders; returns what was deleted.

    Complete = at or before the step in verl's `latest_checkpointed_iteration.txt` (written after a save finished):
    a newer folder is a save cut off by a crash, which verl overwrites, so it neither counts nor is touched."""
    tracker = Path(checkpoints) / "latest_checkpointed_iteration.txt"
    if keep < 1 or not tracker.is_file():
        return []
    latest = int(tracker.read_text().strip())
    steps = sorted((int(m.group(1)), child) for child in Path(checkpoints).glob("global_step_*")
                   if child.is_dir() and (m := _VERL_STEP.match(child.name)) and int(m.group(1)) <= latest)
    removed = [path for _, path in steps[:-keep]]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    if removed:
        log.info("rl.trainer.keep_checkpoints=%d: deleted %s", keep, ", ".join(p.name for p in removed))
    return removed


def drop_optimizer_state(checkpoint: Path, fmt: str) -> int:
    """Delete the optimizer state of a finished stage's final checkpoint (`fmt`: trainer | verl_fsdp, the
    CheckpointRef format; its path is the checkpoint folder or verl's `<global_step>/actor`); returns bytes freed."""
    checkpoint = Path(checkpoint)
    if fmt == "trainer":
        files = [checkpoint / _TRAINER_OPTIMIZER]
    elif fmt == "verl_fsdp":
        files = list(checkpoint.glob(_VERL_OPTIMIZER))
    else:
        return 0
    freed = 0
    for file in files:
        if file.is_file():
            freed += file.stat().st_size
            file.unlink()
    if freed:
        log.info("deleted the finished run's optimizer state in %s (%.2f GB; set rl.trainer.keep_optimizer_state "
                 "to keep it)", checkpoint, freed / 1e9)
    return freed
