"""Trainer internals on a tiny randomly initialised Llama (fast): collation and loss masks, log-probs against an
unpadded forward, gradient accumulation exactness, branch parents, checkpoints, metrics bookkeeping.
(Alarms: test_rl_alarms.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from stages.core.config.rl import RLSection
from stages.generation.types import RolloutBatch, RolloutGroup, Trajectory
from stages.rl import checkpoint as ckpt
from stages.rl.advantages import entropy_scaling
from stages.rl.logprobs import collate, policy_forward
from stages.rl.step_metrics import append_metrics, reconcile_metrics
from stages.rl.trainer import epoch_order, step_counts
from stages.rl.update import StepTensors, _trim, branch_parents, ppo_update

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def traj(i: int, prompt: list[int], response: list[int], mask: list[int], group: int = 0, **kw) -> Trajectory:
    return Trajectory(traj_id=i, group=group, prompt_ids=prompt, response_ids=response, loss_mask=mask, **kw)


def test_collate_layout_and_tool_token_mask():
    # prompts left-padded to P = 3, responses right-padded to T = 4; the tool-result token (mask 0) stays 0
    a = traj(0, [5, 6, 7], [8, 9], [1, 0])
    b = traj(1, [5], [10, 11, 12, 13], [1, 1, 0, 1])
    batch = collate([a, b], pad_id=0)
    assert batch.input_ids_BL.tolist() == [[5, 6, 7, 8, 9, 0, 0], [0, 0, 5, 10, 11, 12, 13]]
    assert batch.attention_mask_BL.tolist() == [[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1]]
    assert batch.position_ids_BL.tolist() == [[0, 1, 2, 3, 4, 4, 4], [0, 0, 0, 1, 2, 3, 4]]
    assert batch.mask_BT.tolist() == [[1, 0, 0, 0], [1, 1, 0, 1]]
    with pytest.raises(ValueError, match="loss-mask"):
        collate([traj(0, [1], [2, 3], [1])], pad_id=0)


def test_policy_forward_matches_unpadded_forward(tiny_llama):
    a = traj(0, [5, 6, 7], [8, 9], [1, 1])
    b = traj(1, [5], [10, 11, 12, 13], [1, 1, 1, 1])
    with torch.no_grad():
        logp, entropy = policy_forward(tiny_llama, collate([a, b], pad_id=0), with_entropy=True)
        for row, t in enumerate([a, b]):
            logits = tiny_llama(torch.tensor([t.prompt_ids + t.response_ids])).logits[0].float()
            ref = torch.log_softmax(logits, -1)
            p = len(t.prompt_ids)
            expected = [ref[p - 1 + i, tok].item() for i, tok in enumerate(t.response_ids)]
            assert logp[row, :len(expected)].tolist() == pytest.approx(expected, abs=1e-5)
            probs = ref[p - 1].exp()
            h0 = -(probs * ref[p - 1]).sum().item() / math.log(64)  # entropy / ln|V| of the first position
            assert entropy[row, 0].item() == pytest.approx(h0, abs=1e-5)
    assert logp[0, 2:].tolist() == [0.0, 0.0]  # padding positions are zero, not garbage


def test_trim_drops_all_padding_columns():
    batch = collate([traj(0, [5, 6, 7], [8], [1]), traj(1, [5], [1, 2, 3, 4], [1, 1, 1, 1])], pad_id=0)
    trimmed, t = _trim(batch.rows_slice(0, 1))
    assert t == 1 and trimmed.input_ids_BL.tolist() == [[5, 6, 7, 8]]


def _step_tensors(rows: int = 4) -> StepTensors:
    gen = torch.Generator().manual_seed(3)
    trajs = [traj(i, [1 + i, 2, 3][: 1 + i % 3], torch.randint(4, 60, (2 + i,), generator=gen).tolist(),
                  [1] * (2 + i), group=i // 2) for i in range(rows)]
    for t in trajs:
        t.loss_mask[0] = 0  # a tool-result token in every row
    batch = collate(trajs, pad_id=0)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5]).unsqueeze(1) * batch.mask_BT
    old = torch.randn(batch.mask_BT.shape, generator=gen) * 0.1 - 3.0
    return StepTensors(batch, torch.zeros(rows), torch.tensor([0, 0, 1, 1]), old * batch.valid_BT, adv)


def _grads_after(model, cfg: RLSection, data: StepTensors) -> dict[str, torch.Tensor]:
    model.zero_grad()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the step leaves weights alone, grads stay
    ppo_update(cfg, model, opt, data, group_size=2, device=torch.device("cpu"))
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_grad_accumulation_equals_one_big_batch(tiny_llama, aggregation):
    # the mini-batch (2 groups x 2 = 4 rows) in micro-batches of 1 row must give the gradient of one batch of 4
    base = {"loss": {"aggregation": aggregation}, "optim": {"grad_clip": 1e9},
            "rollout": {"n": 2, "initial_rollouts": 2, "max_response_length": 8}}
    one = RLSection(**{**base, "trainer": {"ppo_mini_batch_size": 2, "micro_batch_size": 4}})
    many = RLSection(**{**base, "trainer": {"ppo_mini_batch_size": 2, "micro_batch_size": 1}})
    data = _step_tensors()
    g_one, g_many = _grads_after(tiny_llama, one, data), _grads_after(tiny_llama, many, data)
    for name in g_one:
        assert torch.allclose(g_one[name], g_many[name], atol=1e-6, rtol=1e-4), name
    assert any(g.abs().sum() > 0 for g in g_one.values())


def test_branch_parents_map_traj_ids_to_rows():
    # group 0: roots 0, 1; traj 2 forked from traj 1 at 5; group 1: traj 0 root, traj 1 forked from 0 at 3
    g0 = [traj(0, [1], [2], [1]), traj(1, [1], [2], [1]), traj(2, [1], [2], [1], parent_id=1, fork_at=5)]
    g1 = [traj(0, [1], [2], [1], group=1), traj(1, [1], [2], [1], group=1, parent_id=0, fork_at=3)]
    batch = RolloutBatch([RolloutGroup(0, "q", "a", "qa", g0, 2), RolloutGroup(1, "q", "a", "qa", g1, 1)])
    assert branch_parents(batch) == ([None, None, 1, None, 3], [0, 0, 5, 0, 3])


def test_plan_steps_and_epoch_order():
    cfg = RLSection(trainer={"train_batch_size": 4, "epochs": 2})
    assert step_counts(10, cfg) == (2, 4)  # 10 // 4 = 2 batches per epoch (last 2 rows dropped), 2 epochs
    assert step_counts(10, RLSection(trainer={"train_batch_size": 4, "total_steps": 7})) == (2, 7)
    with pytest.raises(ValueError, match="train_batch_size"):
        step_counts(3, cfg)
    order = epoch_order(10, seed=0, epoch=0)
    assert sorted(order) == list(range(10)) and order == epoch_order(10, seed=0, epoch=0)
    assert order != epoch_order(10, seed=0, epoch=1)


def test_checkpoints_atomic_latest_and_pruned(tmp_path, tiny_llama):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, "<unk>")))
    opt = torch.optim.AdamW(tiny_llama.parameters(), lr=1e-3)
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        ckpt.save_checkpoint(root, ckpt.TrainerState(step, 0, step, "h", {"step": step}), tiny_llama, tok, opt,
                             keep=2)
    (root / ".step_000004.tmp-dead").mkdir()       # an interrupted save
    (root / "step_000009").mkdir()                 # a folder without state.json is not a checkpoint
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [2, 3]
    assert ckpt.latest_checkpoint(root).name == "step_000003"
    torch.manual_seed(123)
    ckpt.save_checkpoint(root, ckpt.TrainerState(4, 1, 0, "h"), tiny_llama, tok, opt, keep=1)
    expected = torch.rand(1).item()  # the first draw after the save
    state = ckpt.load_training_state(root / "step_000004", opt)
    assert (state.step, state.epoch, state.position) == (4, 1, 0)
    assert torch.rand(1).item() == expected  # RNG restored to the moment of the save
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [4]
    assert not list(root.glob(".step_*"))


def test_reconcile_metrics_keeps_exactly_one_row_per_checkpointed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for step in (1, 2, 3):
        append_metrics(path, {"step": step, "reward/mean": 0.1 * step})
    # crashed after step 3's row but the newest checkpoint is step 2: row 3 goes (step 3 will be redone)
    assert [r["step"] for r in reconcile_metrics(path, 2, {"step": 2})] == [1, 2]
    # crashed between checkpoint 3 and appending its row: the checkpoint's copy of the row is put back
    assert [r["step"] for r in reconcile_metrics(path, 3, {"step": 3, "reward/mean": 0.3})] == [1, 2, 3]


def test_chunked_logprobs_equal_unchunked():
    from stages.rl import logprobs as lp

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 7, 11, generator=gen)
    targets = torch.randint(0, 11, (2, 7), generator=gen)
    full = lp._token_logprobs(logits, targets, True)
    old, lp.CHUNK = lp.CHUNK, 3  # 7 positions in chunks of 3, 3, 1
    try:
        with torch.no_grad():
            chunked = lp.token_logprobs(logits, targets, True)
    finally:
        lp.CHUNK = old
    assert torch.allclose(full[0], chunked[0], atol=1e-6) and torch.allclose(full[1], chunked[1], atol=1e-6)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_llama):
    import copy

    cfg = RLSection(rollout={"n": 2, "initial_rollouts": 2}, trainer={"ppo_mini_batch_size": 2, "micro_batch_size": 2},
                    optim={"grad_clip": 1e9})
    data = _step_tensors()
    plain = _grads_after(tiny_llama, cfg, data)
    checkpointed = copy.deepcopy(tiny_llama)
    checkpointed.gradient_checkpointing_enable()
    ckpt_grads = _grads_after(checkpointed, cfg, data)
    for name, grad in plain.items():
        assert torch.allclose(grad, ckpt_grads[name], atol=1e-6, rtol=1e-4), name


def test_rollout_dump_and_markdown_sample(tmp_path):
    from stages.agent.rewards import Reward
    from stages.rl.step_metrics import (
        dump_rollouts,
        rollout_metrics,
        rollout_sample_markdown,
    )

    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return " ".join(map(str, ids))

    t0 = traj(0, [1, 2], [3, 4, 5], [1, 0, 1], tool_calls={"search": 1}, finish_reason="eos",
              response_text="<search>q</search> <result>\nr\n</result>")
    t1 = traj(1, [1, 2], [3, 6], [1, 1], parent_id=0, fork_at=1, kind="branch", finish_reason="length",
              response_text="x")
    batch = RolloutBatch([RolloutGroup(0, "question?", "gold", "qa", [t0, t1], 1, branches=1)])
    rewards = [Reward(1.0, True, "f1>0", "gold", 1.0), Reward(-1.0, False, "bad format", None, 0.0)]
    dump_rollouts(tmp_path / "rollouts" / "step_000001.jsonl", 1, batch, rewards, Tok(), [0.7, -0.7])
    text = rollout_sample_markdown(tmp_path / "rollouts")
    assert "Rollouts of step 1" in text and "fork at 1" in text and "reward -1.000 (bad format)" in text
    row = rollout_metrics(batch, rewards)
    # rewards [1, -1]: mean 0, unbiased std sqrt(2) = 1.414214; one tool call over two trajectories -> 0.5
    assert row["reward/mean"] == 0.0 and row["reward/std"] == pytest.approx(1.414214, abs=1e-6)
    assert row["tools/calls_per_traj"] == 0.5 and row["rollout/branches_per_group"] == 1.0
    assert row["response/tool_tokens"] == 0.5 and row["finish/eos"] == 0.5 and row["accuracy"] == 0.5


def test_entropy_scope_micro_batch_scales_with_the_current_policy_per_micro_batch(tiny_llama):
    # the reference's entropy-aware advantage (AEPO core_algos.py 620-638): A * (1 + 0.2 sg(H_std)), H from the
    # current forward pass, standardised over the valid tokens of each micro-batch. With lr 0 the current policy
    # is the model itself, so scaling the advantages by hand per micro-batch (rows 0-1, 2-3) and training with
    # entropy_scope=step on them must give the same gradient as entropy_scope=micro_batch with micro-batches of 2.
    base = {"algorithm": "aepo", "optim": {"grad_clip": 1e9},
            "rollout": {"n": 2, "initial_rollouts": 2, "max_response_length": 8},
            "trainer": {"ppo_mini_batch_size": 2, "micro_batch_size": 2}}
    micro = RLSection(**{**base, "advantage": {"entropy_scope": "micro_batch"}})
    plain = RLSection(**{**base, "advantage": {"entropy_aware": False}})
    data = _step_tensors()
    with torch.no_grad():
        _, entropy = policy_forward(tiny_llama, data.batch, with_entropy=True)
    mask = data.batch.mask_BT
    scaled = torch.cat([data.adv_BT[s:s + 2] * entropy_scaling(entropy[s:s + 2], mask[s:s + 2], 0.2)
                        for s in (0, 2)])
    by_hand = StepTensors(data.batch, data.rewards_B, data.group_B, data.old_logp_BT, scaled)
    g_micro, g_hand = _grads_after(tiny_llama, micro, data), _grads_after(tiny_llama, plain, by_hand)
    for name in g_micro:
        assert torch.allclose(g_micro[name], g_hand[name], atol=1e-6, rtol=1e-4), name
    # standardising over the whole batch instead (one micro-batch of 4) is a different gradient
    whole = torch.allclose(g_micro["lm_head.weight"], _grads_after(tiny_llama, RLSection(**{
        **base, "advantage": {"entropy_scope": "micro_batch"}, "trainer": {"ppo_mini_batch_size": 2,
                                                                          "micro_batch_size": 4}}), data)
        ["lm_head.weight"], atol=1e-6)
    assert not whole
