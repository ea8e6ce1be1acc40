"""The bootstrapped tiny model is a real HF folder that answers a chat prompt."""

from __future__ import annotations

from pathlib import Path

import pytest

from stages.bootstrap import ModelNotAvailableError, bootstrap_model
from stages.core.config.model import ModelSection


def test_tiny_model_answers_a_chat_prompt(tiny_model) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model.path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model.path)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|im_end|>"   # the conversion fix
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "5" in answer
    assert out[0, -1].item() == tokenizer.eos_token_id        # it stops on <|im_end|>


def test_bootstrap_is_reused_not_rebuilt(tiny_config, tiny_model) -> None:
    from tests.conftest import PROJECT_ROOT, TEST_OUTPUTS

    again = bootstrap_model(tiny_config.model, TEST_OUTPUTS, PROJECT_ROOT / ".cache")
    assert again == tiny_model


def test_missing_local_model_says_how_to_provide_it(tmp_path: Path) -> None:
    cfg = ModelSection(source="local", path=str(tmp_path / "nope"))
    with pytest.raises(ModelNotAvailableError, match="huggingface-cli download"):
        bootstrap_model(cfg, tmp_path / "out", tmp_path / "cache")


def test_missing_hub_model_offline_names_the_fix(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cfg = ModelSection(source="hub", path="Qwen/Qwen2.5-7B-Instruct", template="qwen")
    with pytest.raises(ModelNotAvailableError, match=r"not in the local HF cache.*model.source=local"):
        bootstrap_model(cfg, tmp_path / "out", tmp_path / "cache")
