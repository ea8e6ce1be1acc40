"""The step's cheaper paths give the numbers of the plain ones: a micro-batch's prompts run once and its responses
over their KV cache (`rl.trainer.shared_prompt`), and the rollout's own log-probs as the old ones instead of a
no-grad pass (`rl.trainer.old_logprobs`), on a tiny randomly initialised Llama whose trajectories are really sampled
(incremental decoding with a KV cache, as a sampler records log-probs), with a masked tool result and a forced EOS."""

from __future__ import annotations

import copy

import pytest
import torch

from stages.core.config.rl import RLSection
from stages.generation.types import RolloutBatch, RolloutGroup, Trajectory
from stages.rl.logprobs import collate, policy_forward, response_logits
from stages.rl.update import build_step_tensors, old_logprob_source, ppo_update

torch.set_num_threads(1)
VOCAB, EOS = 64, 2
TOL = 1e-5  # float32 rounding of a reordered computation on a 2-layer, 16-wide model stays ~1e-6


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


@torch.no_grad()
def sample(model, prompt: list[int], n: int, gen: torch.Generator) -> tuple[list[int], list[float]]:
    """n tokens sampled at temperature 1 with a KV cache, and the log-prob of each at the moment it was drawn."""
    out = model(torch.tensor([prompt]), use_cache=True)
    ids, logps = [], []
    for _ in range(n):
        logp = torch.log_softmax(out.logits[0, -1].float(), -1)
        tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
        ids.append(tok)
        logps.append(float(logp[tok]))
        out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return ids, logps


def sampled_rollouts(model, seed: int = 0, forced_group: int = 1) -> RolloutBatch:
    """2 groups x 2 trajectories; group prompts differ in length; each trajectory: a sampled segment, a 3-token
    tool result (mask 0, log-prob 0), a second sampled segment; one trajectory ends with an appended EOS."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g, prompt in enumerate([[5, 6, 7, 8, 9], [10, 11, 12]]):
        trajs = []
        for i in range(2):
            first, lp1 = sample(model, prompt, 3 + i + g, gen)
            result = [20, 21, 22]
            second, lp2 = sample(model, prompt + first + result, 2 + i, gen)
            t = Trajectory(traj_id=i, group=g, prompt_ids=prompt, response_ids=first + result + second,
                           loss_mask=[1] * len(first) + [0] * 3 + [1] * len(second),
                           sample_logprobs=lp1 + [0.0] * 3 + lp2)
            if g == forced_group and i == 0:  # the environment's EOS: the policy did not sample it, no log-prob
                t.meta["forced_eos"] = len(t.response_ids)
                t.response_ids.append(EOS)
                t.loss_mask.append(1)
                t.sample_logprobs.append(0.0)
            trajs.append(t)
        groups.append(RolloutGroup(g, "q", "a", "qa", trajs, initial_rollouts=2))
    return RolloutBatch(groups)


def cfg(**trainer) -> RLSection:
    return RLSection(rollout={"n": 2, "initial_rollouts": 2, "max_response_length": 16},
                     optim={"lr": 1e-2, "grad_clip": 1e9},
                     trainer={"train_batch_size": 2, "ppo_mini_batch_size": 1, "micro_batch_size": 2, **trainer})


def test_shared_prompt_forward_gives_the_full_forwards_logprobs_and_gradients(tiny_llama):
    trajs = sampled_rollouts(tiny_llama).trajectories  # rows 0-1 share prompt A, rows 2-3 prompt B (shorter)
    batch = collate(trajs, pad_id=0)
    assert response_logits(tiny_llama, batch) is not None  # the shared path really runs
    results = {}
    for shared in (False, True):
        model = copy.deepcopy(tiny_llama).train()
        logp, entropy = policy_forward(model, batch, with_entropy=True, shared_prompt=shared)
        (logp * batch.mask_BT).sum().backward()
        results[shared] = (logp.detach(), entropy.detach(), {n: p.grad for n, p in model.named_parameters()})
    (lp0, h0, g0), (lp1, h1, g1) = results[False], results[True]
    assert torch.allclose(lp0, lp1, atol=TOL) and torch.allclose(h0, h1, atol=TOL)
    assert lp1[:, 0].abs().min() > 0 and lp1[0, len(trajs[0]):].abs().max() == 0  # real values, zero padding
    for name in g0:  # gradient through the shared prompt KV = sum over the rows that read it
        assert torch.allclose(g0[name], g1[name], atol=TOL, rtol=1e-4), name


def test_shared_prompt_needs_a_shared_prompt(tiny_llama):
    trajs = sampled_rollouts(tiny_llama).trajectories
    distinct = collate([trajs[0], trajs[2]], pad_id=0)  # one row per prompt: nothing to share, plain forward
    assert response_logits(tiny_llama, distinct) is None


def test_auto_uses_the_rollout_logprobs_only_where_the_pass_cannot_change_the_loss():
    assert old_logprob_source(cfg()) == "rollout"
    assert old_logprob_source(cfg(), torch.bfloat16) == "recompute"          # trainer computes in bf16
    assert old_logprob_source(cfg(ppo_epochs=2)) == "recompute"
    assert old_logprob_source(cfg(old_logprobs="recompute")) == "recompute"
    aepo = RLSection(algorithm="aepo")                                         # needs the pass's entropies
    assert old_logprob_source(aepo) == "recompute"
    assert old_logprob_source(RLSection(rollout={"top_p": 0.9})) == "recompute"  # truncated sampler
    with pytest.raises(ValueError, match="entropy_aware"):
        RLSection(algorithm="aepo", trainer={"old_logprobs": "rollout"})
    with pytest.raises(ValueError, match="truncated"):
        RLSection(rollout={"backend": "vllm", "top_p": 0.9}, trainer={"old_logprobs": "rollout"})


def run_update(model, rl: RLSection, rollouts: RolloutBatch):
    model = copy.deepcopy(model).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=rl.optim.lr)
    tensors = build_step_tensors(rl, model, None, rollouts, [1.0, 0.0, 0.5, -1.0], 0, torch.device("cpu"))
    stats = ppo_update(rl, model, optimizer, tensors, 2, torch.device("cpu"))
    return tensors, stats, dict(model.named_parameters())


@pytest.mark.parametrize("shared", [False, True])
def test_rollout_logprobs_give_the_recomputed_loss(tiny_llama, shared):
    # two mini-batches (one group each), AdamW lr 1e-2: the second mini-batch's loss reads the old log-probs after
    # the policy moved, so both sources must agree there too -- they do, because both are the pre-update policy's
    rollouts = sampled_rollouts(tiny_llama)
    recomputed = run_update(tiny_llama, cfg(old_logprobs="recompute", shared_prompt=shared), rollouts)
    from_rollout = run_update(tiny_llama, cfg(old_logprobs="rollout", shared_prompt=shared), rollouts)
    (t_re, s_re, w_re), (t_ro, s_ro, w_ro) = recomputed, from_rollout
    assert t_re.old_source == "recompute" and t_ro.old_source == "rollout"
    assert t_ro.recomputed_rows == 1                                   # only the row with the forced EOS
    mask = t_re.batch.mask_BT.bool()
    assert torch.allclose(t_re.old_logp_BT[mask], t_ro.old_logp_BT[mask], atol=TOL)  # forced EOS included
    assert s_re["optimizer_steps"] == s_ro["optimizer_steps"] == 2
    assert s_ro["loss"] == pytest.approx(s_re["loss"], abs=TOL) and abs(s_re["loss"]) > 1e-3
    assert s_ro["grad_norm"] == pytest.approx(s_re["grad_norm"], abs=TOL, rel=1e-4)
    for name in w_re:
        assert torch.allclose(w_re[name], w_ro[name], atol=TOL), name
    # what the skipped pass reported, the update measured: entropies (the same numbers in the first mini-batch,
    # one AdamW step later in the second) and the sampler's log-prob mismatch before any step
    assert torch.allclose(t_ro.entropy_BT[:2], t_re.entropy_BT[:2], atol=TOL)
    assert 0 <= s_ro["rollout/logp_mismatch"] < TOL


@pytest.mark.parametrize("source", ["recompute", "rollout"])
def test_the_sampler_mismatch_leaves_out_the_environments_eos(tiny_llama, source):
    # the forced EOS in the first mini-batch (group 0), where the mismatch is measured: its placeholder log-prob 0
    # is not the sampler's (the trainer gives it log p ~ -ln 64 = -4.2 here, -17.5 on a real chain run), so the
    # mismatch counts only the tokens the sampler drew and stays at float rounding on both paths
    from stages.rl.trainer import RLTrainer

    rollouts = sampled_rollouts(tiny_llama, forced_group=0)
    tensors, stats, _ = run_update(tiny_llama, cfg(old_logprobs=source), rollouts)
    forced = rollouts.groups[0].trajectories[0].meta["forced_eos"]
    assert tensors.batch.mask_BT[0, forced] == 1 and tensors.sampled_BT[0, forced] == 0
    assert int(tensors.sampled_BT.sum()) == int(tensors.batch.mask_BT.sum()) - 1
    mismatch = stats.get("rollout/logp_mismatch", RLTrainer._tensor_metrics(tensors).get("rollout/logp_mismatch"))
    assert 0 <= mismatch < TOL


def test_rollout_logprobs_with_an_outage_masked_row(tiny_llama):
    # trajectory 1 of group 0 had a tool call the infrastructure failed: the update trains on rows 0, 2, 3 only,
    # and the entropies it measures (in place of the skipped pass) land on those rows of the step's tensors
    rollouts = sampled_rollouts(tiny_llama)
    rollouts.groups[0].trajectories[1].infra_failures = 1
    t_re, s_re, w_re = run_update(tiny_llama, cfg(old_logprobs="recompute"), rollouts)
    t_ro, s_ro, w_ro = run_update(tiny_llama, cfg(old_logprobs="rollout"), rollouts)
    assert t_ro.keep_B.tolist() == [True, False, True, True]
    assert not t_ro.batch.mask_BT[1].any() and not t_ro.entropy_BT[1].any()   # nothing measured on the masked row
    assert t_ro.entropy_BT[0].any()
    assert torch.allclose(t_ro.entropy_BT[0], t_re.entropy_BT[0], atol=TOL)   # first mini-batch: pre-update policy
    assert s_ro["loss"] == pytest.approx(s_re["loss"], abs=TOL)
    for name in w_re:
        assert torch.allclose(w_re[name], w_ro[name], atol=TOL), name
