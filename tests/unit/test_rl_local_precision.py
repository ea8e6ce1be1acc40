"""Local engine: model.dtype sets the compute precision over float32 master weights; gradient checkpointing;
the memory check before loading weights."""

from __future__ import annotations

import pytest
import torch

from stages.core.config.loader import load_config
from stages.core.refs import ModelRef
from stages.generation.types import RolloutBatch, RolloutGroup, Trajectory
from stages.rl.modeling import compute_dtype, configure_for_training, parameters_billion
from stages.rl.update import build_step_tensors, ppo_update

torch.set_num_threads(1)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))


def rollouts() -> RolloutBatch:
    trajs = [Trajectory(traj_id=i, group=0, prompt_ids=[1, 2, 3], response_ids=[4 + i, 5, 6, 7],
                        loss_mask=[1, 1, 0, 1], sample_logprobs=[-1.0] * 4, entropies=[0.5] * 4) for i in range(2)]
    return RolloutBatch([RolloutGroup(0, "q", "a", "qa", trajs, initial_rollouts=2)])


def test_dtype_names():
    assert compute_dtype("bfloat16") is torch.bfloat16 and compute_dtype("float32") is torch.float32
    with pytest.raises(ValueError, match="bfloat16"):
        compute_dtype("float16")


def test_bfloat16_weights_could_not_learn_at_rl_learning_rates():
    # why the trainer keeps float32 master weights: a 1e-6 update of a 0.02 weight is below bfloat16's spacing
    # there (2^-6 * 2^-7 ~ 1.2e-4), so it rounds away; in float32 it survives
    w = torch.tensor(0.02)
    assert (w.bfloat16() + 1e-6) == w.bfloat16() and (w + 1e-6) != w


def test_gradient_checkpointing_is_switched_on():
    model = configure_for_training(tiny_llama(), gradient_checkpointing=True)
    assert model.is_gradient_checkpointing and model.config.use_cache is False
    assert not configure_for_training(tiny_llama(), gradient_checkpointing=False).is_gradient_checkpointing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_computes_in_model_dtype_over_float32_weights(dtype):
    cfg = load_config("tiny-cpu", ["rl.rollout.n=2", "rl.trainer.micro_batch_size=1", "rl.trainer.ppo_mini_batch_size=1",
                                   "rl.optim.lr=1e-3"]).rl
    model = configure_for_training(tiny_llama(), gradient_checkpointing=True)
    seen = []
    model.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tensors = build_step_tensors(cfg, model, None, rollouts(), [1.0, 0.0], 0, torch.device("cpu"), dtype)
    stats = ppo_update(cfg, model, optimizer, tensors, 2, torch.device("cpu"), dtype)
    assert set(seen) == {dtype}                                        # logits computed in model.dtype
    assert all(p.dtype is torch.float32 for p in model.parameters())   # master weights stay float32
    assert stats["optimizer_steps"] == 1 and torch.isfinite(torch.tensor(stats["grad_norm"]))
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_parameter_count_comes_from_the_config_without_weights(tmp_path):
    model = tiny_llama()
    model.config.save_pretrained(tmp_path)  # config only: nothing to load
    exact = sum(p.numel() for p in model.parameters()) / 1e9
    assert parameters_billion(ModelRef(path=str(tmp_path), fingerprint="x")) == pytest.approx(exact)
