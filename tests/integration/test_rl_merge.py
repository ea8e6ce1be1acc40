"""Merge stage on the tiny model: trainer checkpoint / LoRA / HF -> HF folder, parity probe passes; a corrupted
checkpoint fails it with the largest difference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from stages.core.config.merge import MergeSection
from stages.core.refs import CheckpointRef
from stages.rl import checkpoint as ckpt
from stages.rl.merge import merge_checkpoint
from stages.rl.merge_weights import MergeParityError
from stages.rl.probe import probe_logprobs, probe_sequences, read_probe, write_probe
from tests.conftest import module_scratch

pytestmark = pytest.mark.integration
torch.set_num_threads(1)


def _load(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa"),
            AutoTokenizer.from_pretrained(path))


@pytest.fixture(scope="module")
def trainer_checkpoint(request, tiny_model, tmp_path_factory) -> CheckpointRef:
    """A trainer checkpoint whose weights differ from the base (as after training), with its probe."""
    model, tok = _load(tiny_model.path)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-3)
    root = module_scratch(request, tmp_path_factory.mktemp("rl")) / "checkpoints"
    path = ckpt.save_checkpoint(root, ckpt.TrainerState(3, 0, 3), model, tok, optimizer=None)
    write_probe(path, model, tok)
    return CheckpointRef(path=str(path), fingerprint="trained-3", format="trainer", base=tiny_model, step=3)


def test_trainer_checkpoint_merges_with_parity(trainer_checkpoint, tiny_model, tmp_path):
    ref = merge_checkpoint(MergeSection(), trainer_checkpoint, tmp_path)
    folder = Path(ref.path)
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
        assert (folder / name).is_file(), name
    assert ref.meta["max_abs_diff"] <= 1e-4
    assert ref.template == tiny_model.template
    # the merged folder is a plain HF model reproducing the trainer's probe log-probs
    merged, tok = _load(ref.path)
    probe = read_probe(Path(trainer_checkpoint.path))
    actual = probe_logprobs(merged, probe["sequences"])
    assert max(abs(a - b) for x, y in zip(actual, probe["logprobs"]) for a, b in zip(x, y)) <= 1e-4
    assert tok.eos_token == "<|im_end|>"
    # cached: a second call returns the same ref without work
    assert merge_checkpoint(MergeSection(), trainer_checkpoint, tmp_path).fingerprint == ref.fingerprint


def test_corrupted_checkpoint_fails_the_parity_probe(trainer_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad_ckpt"
    shutil.copytree(trainer_checkpoint.path, bad)
    weights = load_file(str(bad / "model" / "model.safetensors"))
    name = next(k for k in weights if "layers.0.self_attn.q_proj.weight" in k)
    weights[name] = weights[name] * 1.5  # a deliberately wrong tensor after the probe was recorded
    save_file(weights, str(bad / "model" / "model.safetensors"), metadata={"format": "pt"})
    corrupted = trainer_checkpoint.model_copy(update={"path": str(bad), "fingerprint": "corrupted"})
    with pytest.raises(MergeParityError, match=r"loaded in float32 gives max \|logp merged - logp trained\| = .* above"):
        merge_checkpoint(MergeSection(), corrupted, tmp_path / "out")
    assert not list((tmp_path / "out" / "merge").glob("*/_COMPLETE.json"))
    assert not list((tmp_path / "out" / "merge").glob("*/model*"))  # no model, no half-written model.partial


def test_bfloat16_merge_checks_the_merge_not_the_rounding(trainer_checkpoint, tmp_path):
    from safetensors import safe_open

    ref = merge_checkpoint(MergeSection(dtype="bfloat16"), trainer_checkpoint, tmp_path)
    report = json.loads((Path(ref.path).parent / "merge_report.json").read_text())
    assert report["load_diff"] <= 1e-4 and report["merge_diff"] <= 1e-4
    assert report["dtype_rounding_diff"] > 1e-3  # rounding to bf16 alone moves log-probs far beyond 1e-4
    with safe_open(str(Path(ref.path) / "model.safetensors"), "pt") as handle:
        assert handle.get_tensor(next(iter(handle.keys()))).dtype == torch.bfloat16


def test_lora_adapter_merges_with_parity(tiny_model, tmp_path):
    from peft import LoraConfig, get_peft_model

    model, tok = _load(tiny_model.path)
    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                  init_lora_weights=False))  # random B: the adapter changes outputs
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(adapter)
    lora = CheckpointRef(path=str(adapter), fingerprint="lora-1", format="lora", base=tiny_model)
    ref = merge_checkpoint(MergeSection(), lora, tmp_path / "out")
    assert ref.meta["max_abs_diff"] <= 1e-4
    assert not (Path(ref.path) / "adapter_config.json").exists()  # plain weights, no adapter left
    # the adapter really moved the model: merged log-probs differ from the base model's
    base, _ = _load(tiny_model.path)
    seqs = probe_sequences(tok)
    merged, _ = _load(ref.path)
    base_lp, merged_lp = probe_logprobs(base, seqs), probe_logprobs(merged, seqs)
    assert max(abs(a - b) for x, y in zip(base_lp, merged_lp) for a, b in zip(x, y)) > 1e-2
