"""The verl engine for real (GPU box only; not run in CI, where there is no GPU, vLLM or verl with vLLM):

    ./scripts/setup-gpu.sh
    .venv-verl/bin/python -m pytest -m gpu tests/integration/test_rl_verl_gpu.py

On the tiny model (one GPU): 2 ARPO steps with a checkpoint after each; a second run_rl on the same inputs is a
cache hit; with step 2 removed (as after a crash between the checkpoints) re-running resumes from global_step_1
(verl's auto-resume) and writes step 2 again; the merge stage turns the verl checkpoint into an HF folder with
parity. The tiny model and its data are made by the project venv (bootstrap needs the gguf stack)."""

from __future__ import annotations

import importlib.util

import pytest

from stages.core.config.loader import load_config
from stages.core.env import PROJECT_ROOT
from stages.core.isolate import call_in_interpreter

pytestmark = [pytest.mark.gpu, pytest.mark.integration]
MAIN_PYTHON = str(PROJECT_ROOT / ".venv" / "bin" / "python")
OVERRIDES = ["rl.engine=verl", "rl.algorithm=arpo", "rl.rollout.n=4", "rl.rollout.initial_rollouts=2",
             "rl.trainer.train_batch_size=2", "rl.trainer.ppo_mini_batch_size=2", "rl.trainer.micro_batch_size=2",
             "rl.trainer.total_steps=2", "rl.trainer.save_every=1", "rl.verl.n_gpus_per_node=1",
             "rl.verl.agent_workers=1", "rl.verl.gpu_memory_utilization=0.3"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    if importlib.util.find_spec("verl") is None or importlib.util.find_spec("vllm") is None:
        pytest.fail("run this test with .venv-verl/bin/python (./scripts/setup-gpu.sh builds it)")
    cfg = load_config("tiny-cpu", OVERRIDES)
    root = tmp_path_factory.mktemp("verl-gpu")
    model = call_in_interpreter(MAIN_PYTHON, "stages.bootstrap.model:bootstrap_model",
                                {"cfg": cfg.model, "output_root": str(root), "cache_root": str(PROJECT_ROOT / ".cache")})
    data = call_in_interpreter(MAIN_PYTHON, "stages.data.prepare:prepare_data",
                               {"cfg": cfg.data, "output_root": str(root)})
    return cfg, model, data, root


def test_verl_engine_trains_resumes_and_merges(inputs):
    import json
    from pathlib import Path

    from stages.rl.merge import merge_checkpoint
    from stages.rl.stage import run_rl

    cfg, model, data, root = inputs
    ref = run_rl(cfg.rl, cfg.agent, model, data, root, PROJECT_ROOT / ".cache", seed=0, dtype="bfloat16")
    assert ref.format == "verl_fsdp" and ref.step == 2 and Path(ref.path).name == "actor"
    rows = [json.loads(line) for line in Path(ref.meta["metrics"]).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    again = run_rl(cfg.rl, cfg.agent, model, data, root, PROJECT_ROOT / ".cache", seed=0, dtype="bfloat16")
    assert again.fingerprint == ref.fingerprint                          # cached stage
    import shutil

    stage, checkpoints = Path(ref.meta["metrics"]).parent, Path(ref.path).parents[1]
    shutil.rmtree(checkpoints / "global_step_2")
    (checkpoints / "latest_checkpointed_iteration.txt").write_text("1")
    (stage / "_COMPLETE.json").unlink()
    resumed = run_rl(cfg.rl, cfg.agent, model, data, root, PROJECT_ROOT / ".cache", seed=0, dtype="bfloat16")
    assert resumed.step == 2 and "global_step_1" in (stage / "verl.log").read_text().split("Resuming from")[-1][:300]
    merged = merge_checkpoint(cfg.merge, ref, root)
    assert merged.meta["max_abs_diff"] <= cfg.merge.parity_atol
