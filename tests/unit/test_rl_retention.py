"""What a finished or resumed RL stage keeps on disk (stages/rl/retention.py), on hand-made checkpoint folders."""

from __future__ import annotations

from pathlib import Path

from stages.rl.retention import drop_optimizer_state, prune_verl_checkpoints


def verl_step(root: Path, step: int) -> Path:
    actor = root / f"global_step_{step}" / "actor"
    actor.mkdir(parents=True)
    (actor / "model_world_size_2_rank_0.pt").write_bytes(b"m" * 10)
    for rank in (0, 1):
        (actor / f"optim_world_size_2_rank_{rank}.pt").write_bytes(b"o" * 20)
    return actor


def test_pruning_keeps_the_newest_complete_steps_and_never_a_cut_off_save(tmp_path):
    for step in (1, 2, 3, 4):
        verl_step(tmp_path, step)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3\n")   # step 4: a save a crash cut off
    removed = prune_verl_checkpoints(tmp_path, keep=1)
    assert sorted(p.name for p in removed) == ["global_step_1", "global_step_2"]
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_3", "global_step_4"]


def test_pruning_keeps_two_when_asked_and_does_nothing_before_the_first_save(tmp_path):
    for step in (2, 4, 6):
        verl_step(tmp_path, step)
    assert prune_verl_checkpoints(tmp_path, keep=2) == []                 # no tracker yet: verl never finished one
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("6")
    assert [p.name for p in prune_verl_checkpoints(tmp_path, keep=2)] == ["global_step_2"]


def test_dropping_the_optimizer_state_of_both_formats(tmp_path):
    actor = verl_step(tmp_path, 1)
    assert drop_optimizer_state(actor, "verl_fsdp") == 40
    assert sorted(p.name for p in actor.iterdir()) == ["model_world_size_2_rank_0.pt"]
    trainer = tmp_path / "step_000003"
    (trainer / "model").mkdir(parents=True)
    (trainer / "optimizer.pt").write_bytes(b"x" * 7)
    assert drop_optimizer_state(trainer, "trainer") == 7
    assert not (trainer / "optimizer.pt").exists() and (trainer / "model").is_dir()
    assert drop_optimizer_state(trainer, "trainer") == 0                  # already gone: nothing to do
    assert drop_optimizer_state(tmp_path, "hf") == 0                      # a pass-through policy is not ours to touch
