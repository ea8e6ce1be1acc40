"""LoRA SFT on the tiny model: `llamafactory-cli export` merges the adapter into a plain HF folder that computes
what base + adapter compute; a run that crashed after a checkpoint resumes from it instead of starting over."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from stages.core.config.sft import SFTSection
from stages.core.workspace import MARKER
from stages.sft import run_sft
from tests.conftest import TEST_OUTPUTS, release_in_ci

pytestmark = [pytest.mark.integration, pytest.mark.slow]
release_outputs = release_in_ci("sft-lora")
torch.set_num_threads(1)

ANSWER = ("<think> multiply </think>\n<python>\nprint({i} * 7)\n</python> <result>\n{v}\n</result>\n"
          "<think> done </think>\n<answer> The final answer is \\[ \\boxed{{{v}}} \\] </answer>")
ROWS = [{"conversations": [{"from": "human", "value": f"What is {i} * 7?"},
                           {"from": "gpt", "value": ANSWER.format(i=i, v=i * 7)}], "system": "Use the tools."}
        for i in range(8)]


@pytest.fixture(scope="module")
def lora_run(tiny_config, tiny_model, tmp_path_factory):
    data_file = tmp_path_factory.mktemp("lora") / "arpo_sft.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = SFTSection(dataset="file", dataset_path=str(data_file), finetuning_type="lora", lora_rank=8,
                     learning_rate=1e-3, max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                     cutoff_len=256, warmup_ratio=0.0, bf16=False, preprocessing_num_workers=1,
                     dataloader_num_workers=0, save_steps=2, keep_checkpoints=True)
    root = str(TEST_OUTPUTS / "sft-lora")
    shutil.rmtree(root, ignore_errors=True)  # earlier code versions left their own keys: keep the disk bounded
    ref = run_sft(cfg, tiny_config.agent, tiny_model, None, root, ".cache", force=True)
    return cfg, root, ref


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_merged_folder_equals_base_plus_adapter(lora_run, tiny_model) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, _, ref = lora_run
    folder = Path(ref.path)
    assert (folder / "config.json").is_file() and not (folder / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(ref.path, dtype=torch.float32)
    assert merged.dtype == torch.float32  # export pinned float32; LLaMA-Factory's "auto" would give bfloat16
    adapter = Path(ref.meta["stage_dir"]) / "trainer"
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model.path, dtype=torch.float32),
                                     str(adapter))
    base = AutoModelForCausalLM.from_pretrained(tiny_model.path, dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(ref.path)("<think> 3 * 7 </think>", return_tensors="pt")["input_ids"]
    merged_logits, peft_logits, base_logits = _logits(merged, ids), _logits(peft, ids), _logits(base, ids)
    # the adapter forward computes W x + (B A x) * alpha/r, the merged one (W + B A * alpha/r) x: equal up to float32
    # rounding summed over 30 layers (measured 1e-4 on logits of magnitude ~33; 1e-3 leaves 10x headroom)
    assert torch.allclose(merged_logits, peft_logits, atol=1e-3, rtol=0)
    # and bit-for-bit what peft's own merge gives
    assert torch.equal(merged_logits, _logits(peft.merge_and_unload(), ids))
    # and the adapter learned something: lr 1e-3 for 4 steps moves the logits far beyond rounding
    assert (merged_logits - base_logits).abs().max() > 1e-2
    assert AutoTokenizer.from_pretrained(ref.path).eos_token == "<|im_end|>"


def test_crashed_run_resumes_from_its_last_checkpoint(lora_run, tiny_config, tiny_model) -> None:
    cfg, root, ref = lora_run
    folder = Path(ref.meta["stage_dir"])
    trainer = folder / "trainer"
    assert sorted(p.name for p in trainer.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    # simulate a crash during step 3: only checkpoint-2 was written, nothing after it
    shutil.rmtree(trainer / "checkpoint-4")
    for name in ("all_results.json", "train_results.json", "adapter_model.safetensors", MARKER):
        (trainer / name).unlink(missing_ok=True)
    (folder / MARKER).unlink()
    shutil.rmtree(folder / "model")
    log_lines = len((folder / "train.log").read_text().splitlines())
    again = run_sft(cfg, tiny_config.agent, tiny_model, None, root, ".cache")
    resumed_log = "\n".join((folder / "train.log").read_text().splitlines()[log_lines:])
    assert "resume_from_checkpoint" in (folder / "train.yaml").read_text()
    assert str(trainer / "checkpoint-2") in (folder / "train.yaml").read_text()
    # only steps 3 and 4 were trained again: two loss lines after the resume
    assert resumed_log.count("'loss':") == 2
    assert again.step == 4 and Path(again.path, "config.json").is_file()
