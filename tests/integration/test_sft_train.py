"""SFT for real on the tiny model (CPU): teacher data from the generated task set with the real tools, result
masking, LLaMA-Factory full fine-tuning, the handed-on HF folder, and the cached rerun."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stages.agent.protocol import check_format, count_tool_calls
from stages.core.atomic import read_jsonl
from stages.sft import run_sft
from tests.conftest import TEST_OUTPUTS, release_in_ci

pytestmark = pytest.mark.integration
release_outputs = release_in_ci("sft-train", "sft-off")
torch.set_num_threads(1)

# 8 teacher trajectories, 4 optimizer steps of batch 2 (one epoch), lr high enough to move a 135M model visibly.
# CPU cost is ~6 x 135M FLOPs per token: cutoff 512 keeps a step at ~1k tokens (search trajectories are cut inside
# their last result, which masking then covers to the end).
OVERRIDES = dict(n_trajectories=8, max_steps=4, learning_rate=5e-5, warmup_ratio=0.0, cutoff_len=512,
                 mask_tool_results=True)


@pytest.fixture(scope="module")
def trained(tiny_config, tiny_model, synthetic_data):
    cfg = tiny_config.sft.model_copy(update=OVERRIDES)
    root = TEST_OUTPUTS / "sft-train"
    shutil.rmtree(root, ignore_errors=True)  # earlier code versions left their own keys: keep the disk bounded
    ref = run_sft(cfg, tiny_config.agent, tiny_model, synthetic_data, str(root), str(TEST_OUTPUTS.parent), force=True)
    return cfg, ref


def test_teacher_dataset_is_train_split_tir_text(trained, synthetic_data) -> None:
    _, ref = trained
    folder = Path(ref.meta["stage_dir"])
    rows = read_jsonl(folder / "dataset" / "arpo_sft.jsonl")
    train_ids = {t["id"] for t in read_jsonl(synthetic_data.file("tasks")) if t["split"] == "train"}
    assert len(rows) == 8 and {r["id"] for r in rows} <= train_ids
    for row in rows:
        text = row["conversations"][1]["value"]
        assert check_format(text).ok
        assert sum(count_tool_calls(text).values()) >= 1 and f"\\boxed{{{row['answer']}}}" in text
    assert json.loads((folder / "dataset" / "dataset_info.json").read_text())["arpo_sft"]["formatting"] == "sharegpt"


def test_training_ran_loss_fell_and_results_were_masked(trained) -> None:
    _, ref = trained
    metrics = ref.meta["metrics"]
    assert metrics["global_step"] == 4 and ref.step == 4
    assert metrics["loss_last"] < metrics["loss_first"]
    assert metrics["mask_masked_tokens"] > 0  # every trajectory has at least one <result>
    assert "tokenized_path" in (Path(ref.meta["stage_dir"]) / "train.yaml").read_text()
    assert Path(ref.meta["loss_png"]).stat().st_size > 1000


def test_every_weight_tensor_changed(trained, tiny_model) -> None:
    _, ref = trained
    base = load_file(str(Path(tiny_model.path) / "model.safetensors"))
    tuned = load_file(str(Path(ref.path) / "model.safetensors"))
    assert base.keys() == tuned.keys()
    unchanged = [name for name in base if torch.equal(base[name], tuned[name])]
    assert unchanged == []


def test_checkpoint_loads_keeps_eos_and_generates(trained) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, ref = trained
    assert ref.format == "hf" and ref.base is not None
    tokenizer = AutoTokenizer.from_pretrained(ref.path)
    model = AutoModelForCausalLM.from_pretrained(ref.path)
    eos = model.generation_config.eos_token_id  # LLaMA-Factory writes the template's stop words as a list
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id in (eos if isinstance(eos, list) else [eos])
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]


def test_cached_rerun_does_no_work(trained, tiny_config, tiny_model, synthetic_data) -> None:
    cfg, ref = trained
    folder = Path(ref.meta["stage_dir"])
    before = {p: p.stat().st_mtime_ns for p in folder.rglob("*")}
    again = run_sft(cfg, tiny_config.agent, tiny_model, synthetic_data, str(TEST_OUTPUTS / "sft-train"),
                    str(TEST_OUTPUTS.parent))
    assert again == ref
    assert {p: p.stat().st_mtime_ns for p in folder.rglob("*")} == before  # nothing rebuilt, nothing rewritten
    # later stages' settings (tool limits, the DPO block) do not change the SFT key
    limits = tiny_config.agent.limits.model_copy(update={"max_calls": 2})
    other = tiny_config.agent.model_copy(update={"limits": limits})
    assert run_sft(cfg.model_copy(update={"dpo": cfg.dpo.model_copy(update={"beta": 0.2})}), other, tiny_model,
                   synthetic_data, str(TEST_OUTPUTS / "sft-train"), str(TEST_OUTPUTS.parent)) == ref


def test_disabled_sft_hands_the_model_on(tiny_config, tiny_model, synthetic_data) -> None:
    cfg = tiny_config.sft.model_copy(update={"enabled": False})
    ref = run_sft(cfg, tiny_config.agent, tiny_model, synthetic_data, str(TEST_OUTPUTS / "sft-off"), ".cache")
    assert (ref.path, ref.fingerprint, ref.format, ref.base) == (tiny_model.path, tiny_model.fingerprint, "hf",
                                                                 tiny_model)


def test_prefect_task_is_cached_and_publishes_loss_and_metrics(trained, tiny_config, tiny_model, synthetic_data,
                                                                prefect_harness) -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client

    from tasks.stage_tasks import entry_task

    cfg, ref = trained

    @flow
    def sft_only() -> tuple[str, str]:
        state = entry_task("sft")(cfg, tiny_config.agent, tiny_model, synthetic_data, str(TEST_OUTPUTS / "sft-train"),
                                  str(TEST_OUTPUTS.parent), return_state=True)
        return state.name, state.result().fingerprint

    # the stage folder is complete, so the task's first run only reads it (and publishes); the second is a hit
    assert sft_only() == ("Completed", ref.fingerprint)
    assert sft_only() == ("Cached", ref.fingerprint)

    async def artifact_keys() -> set[str]:
        async with get_client() as client:
            return {a.key for a in await client.read_artifacts() if a.key}

    assert {"sft-loss", "sft-metrics"} <= asyncio.run(artifact_keys())
