"""The memory model of `arpo plan` (stages/cost/memory.py): architectures, verl's micro-batch partition, the
full-vocabulary copies per pass, the per-phase sums, and `arpo run`'s refusal with its fix. Hand-derived numbers."""

from __future__ import annotations

import pytest

from stages.core.archs import ARCHS, Arch, arch_for
from stages.core.config.loader import load_config
from stages.core.errors import BadInputError
from stages.cost.memory import (
    GIB,
    RESERVE_GIB,
    activation_bytes,
    check_memory,
    logits_bytes,
    mask_bytes,
    memory_estimate,
    split_counts,
)
from stages.cost.partition import MicroBatch, fixed_micro_batches, micro_batches, workload

PROFILE_14B = "arpo-qwen3-14b-deepsearch"


def test_parameter_counts_from_the_published_configs():
    # Qwen2.5-7B: per layer q 3584^2 + 3584 bias, k and v 3584*512 + 512 each, o 3584^2, MLP 3*3584*18944,
    # norms 2*3584 -> 233,057,792; x 28 = 6,525,618,176; embedding + untied head 2*152064*3584 = 1,089,994,752;
    # final norm 3584 -> 7,615,616,512 (published: 7.61B)
    assert ARCHS["qwen2.5-7b"].params == 7_615_616_512
    # Qwen3-14B: per layer q, o 5120^2 each, k, v 5120*1024 each, q/k norm 2*128, MLP 3*5120*17408, norms 2*5120
    # -> 330,311,936; x 40 = 13,212,477,440; embedding + head 2*151936*5120 = 1,555,824,640; + 5120 -> 14,768,307,200
    assert ARCHS["qwen3-14b"].params == 14_768_307_200
    assert arch_for("Qwen3-14B", None)[0] == "qwen3-14b"
    assert arch_for(None, "Qwen/Qwen2.5-7B-Instruct")[0] == "qwen2.5-7b"
    assert arch_for("SomeModel-1B") is None


def test_dynamic_micro_batches_pad_past_the_budget():
    # 7 sequences, 20 real tokens, budget 10 -> ceil(20/10) = 2 micro-batches; workloads 24576 L + L^2:
    # 8 -> 196,672, 2 -> 49,156; Karmarkar-Karp balances {8, 2} (245,828) against {2 x 5} (245,780); both hold
    # 10 real tokens (within the budget), but {8, 2} padded to its longest is 2 x 8 = 16 tokens
    mbs = micro_batches([8, 2, 2, 2, 2, 2, 2], budget=10)
    assert sorted(mb.lengths for mb in mbs) == [(2, 2, 2, 2, 2), (8, 2)]
    assert [mb.real for mb in mbs] == [10, 10] and max(mb.padded for mb in mbs) == 16
    assert workload(8) == 196_672
    # real tokens over budget force one more micro-batch: [6, 6, 6] in budget 10 -> 2 is not enough -> 3
    assert len(micro_batches([6, 6, 6], 10)) == 3
    with pytest.raises(ValueError, match="cannot hold"):
        micro_batches([12], 10)
    assert [mb.lengths for mb in fixed_micro_batches([5, 4, 3], 2)] == [(5, 4), (3,)]


def test_full_vocabulary_copies_per_pass():
    mb = MicroBatch((8, 2))          # 16 tokens padded, 10 real; V = 100, 2 bytes
    # old log-prob, no remove-padding: logits 16 + entropy's softmax and temporary 2 x 16 = 48 x 100 x 2 = 9,600
    assert logits_bytes(mb, 100, 2, False, "old_log_prob") == 9_600
    # temperature 0.7: one scaled copy more, 64 -> 12,800
    assert logits_bytes(mb, 100, 2, False, "old_log_prob", temperature=0.7) == 12_800
    # reference (no entropy): logits 16 + packed real 10 = 26 -> 5,200
    assert logits_bytes(mb, 100, 2, False, "ref_log_prob") == 5_200
    # update: 2 x 16 (logits, their grad) + 10 packed + 2 x 10 (saved log-softmax, its grad) = 62 -> 12,400
    assert logits_bytes(mb, 100, 2, False, "update") == 12_400
    # remove-padding: 10 real tokens, 3 copies -> 6,000; chunked entropy: 10 + 3 chunks x 10 x 2 (float32) = 70
    # -> 14,000 (chunks of up to 2048 tokens: only worth it when a micro-batch has more tokens than that)
    assert logits_bytes(mb, 100, 2, True, "old_log_prob") == 6_000
    assert logits_bytes(mb, 100, 2, True, "old_log_prob", chunked_entropy=True) == 14_000


def test_activations():
    arch = Arch(hidden=4, layers=3, intermediate=8, heads=1, kv_heads=1, vocab=100)
    mb = MicroBatch((8, 2))          # 16 padded tokens
    # no grad: 16 x (2*4 + 3*8) = 512 elements x 2 bytes
    assert activation_bytes(arch, mb, 2, False, grad=False, checkpointing=True, attn="sdpa") == 1_024
    # grad, checkpointing: 3 layers x 16 x 4 = 192 + one layer 16 x (7*4 + 4*4 + 4*8) = 1,216 -> 1,408 x 2
    assert activation_bytes(arch, mb, 2, False, grad=True, checkpointing=True, attn="sdpa") == 2_816
    # grad, no checkpointing: 3 x 1,216 = 3,648 x 2
    assert activation_bytes(arch, mb, 2, False, grad=True, checkpointing=False, attn="sdpa") == 7_296
    # eager attention: + 2 x 2 rows x 1 head x 8^2 = 256 elements
    assert activation_bytes(arch, mb, 2, False, grad=False, checkpointing=True, attn="eager") == 1_536


def test_sdpa_attention_mask():
    mb = MicroBatch((8, 2))
    # padded: a boolean [2, 1, 8, 8] = 128 elements, and its conversion to the 2-byte compute dtype -> 384
    assert mask_bytes(mb, 2, False, "sdpa") == 384
    # packed: one [1, 1, 10, 10] block-diagonal mask = 100 x 3 -> 300
    assert mask_bytes(mb, 2, True, "sdpa") == 300
    # none: rows of one length (is_causal), a single packed sequence, flash-attn (no mask), eager (its scores)
    assert mask_bytes(MicroBatch((4, 4)), 2, False, "sdpa") == mask_bytes(MicroBatch((9,)), 2, True, "sdpa") == 0
    assert mask_bytes(mb, 2, True, "flash_attention_2") == mask_bytes(mb, 2, False, "eager") == 0
    # packed eager: scores and probabilities over one row of 10 tokens, 2 x 1 head x 10^2 = 200 more elements
    arch = Arch(hidden=4, layers=3, intermediate=8, heads=1, kv_heads=1, vocab=100)
    assert activation_bytes(arch, mb, 2, True, grad=False, checkpointing=True, attn="eager") == \
        (10 * (2 * 4 + 3 * 8) + 200) * 2


def test_remove_padding_under_sdpa_is_priced_like_flash_attention():
    sdpa = memory_estimate(load_config(PROFILE_14B, []))                  # auto: sdpa + qwen3 -> packed
    flash = memory_estimate(load_config(PROFILE_14B, ["rl.verl.attn_implementation=flash_attention_2"]))
    padded = memory_estimate(load_config(PROFILE_14B, ["rl.verl.remove_padding=false"]))
    assert "remove-padding on (rl.verl.remove_padding: auto, sdpa, qwen3 family)" in sdpa.notes[1]
    for name in ("old_log_prob", "actor_update"):
        s, f = sdpa.phase(name), flash.phase(name)
        assert s.micro_batch == f.micro_batch and "packed tokens" in s.micro_batch
        assert {k: v for k, v in s.parts.items() if k != "attention mask (sdpa)"} == f.parts
        assert "attention mask (sdpa)" not in f.parts
    # the worst old-log-prob micro-batch: 23,146 packed tokens, a [1, 1, T, T] boolean + its bf16 copy
    assert sdpa.phase("old_log_prob").parts["attention mask (sdpa)"] == pytest.approx(23_146 ** 2 * 3 / GIB)
    assert padded.phase("old_log_prob").gib - sdpa.phase("old_log_prob").gib > 15    # ~67 vs ~51 GiB
    assert "8 x" not in sdpa.phase("old_log_prob").micro_batch


def test_split_counts():
    # 12 over 35/45/20 %: 4.2, 5.4, 2.4 -> floors 4, 5, 2 (11); the largest remainder (.4, the earlier pair) +1
    assert split_counts([(0.35, 0.1), (0.45, 0.4), (0.2, 1.0)], 12) == [4, 6, 2]


def test_rollout_phase_of_the_14b_profile():
    est = memory_estimate(load_config(PROFILE_14B, []))
    rollout = est.phase("rollout")
    # 8 GPUs: fp32 shard 4 x 14,768,307,200 / 8 = 7,384,153,600 B = 6.877 GiB; AdamW 8 B/param -> 13.754 GiB;
    # vLLM 0.6 x 80 = 48 GiB; reserve 2 -> 70.63 GiB
    assert rollout.parts["vLLM (weights + KV cache)"] == pytest.approx(48.0)
    assert rollout.parts["actor params (fp32 shard)"] == pytest.approx(7_384_153_600 / GIB)
    assert rollout.parts["optimizer state"] == pytest.approx(2 * 7_384_153_600 / GIB)
    assert rollout.gib == pytest.approx(48 + 3 * 7_384_153_600 / GIB + RESERVE_GIB)
    # per GPU 64 x 12 / 8 = 96 sequences: 34 short, 43 medium, 19 long (2000 + 6192 = 8192 tokens)
    assert "96 sequences per step, 12 per mini-batch" in est.notes[1]


@pytest.mark.parametrize("profile", [PROFILE_14B, "aepo-qwen3-14b-deepsearch", "arpo-qwen2.5-7b-reasoning"])
def test_shipped_profiles_fit_an_80_gib_gpu(profile):
    est = check_memory(load_config(profile, []), {"rl"})
    assert est is not None and not est.over, [(p.name, round(p.gib, 1)) for p in est.phases]


def test_run_refuses_the_reference_budget_naming_phase_and_fix():
    # the reference's 16384 (log-prob budget 32768) without remove-padding: a micro-batch of 8 sequences padded to
    # 8192 tokens, 65,536 x 151,936 x 2 B = 18.5 GiB of logits, x 3 with the unchunked entropy: ~90 GiB, + the
    # [8, 1, 8192, 8192] sdpa mask (1.5 GiB)
    cfg = load_config(PROFILE_14B, ["rl.verl.max_token_len_per_gpu=16384", "rl.verl.remove_padding=false"])
    with pytest.raises(BadInputError) as err:
        check_memory(cfg, {"data", "rl"})
    text = str(err.value)
    assert "old_log_prob needs ~91" in text and "8 x 8192 = 65,536 tokens" in text
    assert "lower rl.verl.max_token_len_per_gpu (now 16384" in text and "rl.verl.remove_padding: true" in text
    assert "optimizer_offload: true" in text
    from stages.core.stage_spec import MEMORY, TABLE

    assert MEMORY in TABLE.checks({"rl"}) and MEMORY not in TABLE.checks({"data", "sft"})  # RL not selected: not run
    # remove-padding (sdpa, auto for qwen3; or flash-attn) fits the same budget: only real tokens are materialised
    for extra in ([], ["rl.verl.attn_implementation=flash_attention_2"]):
        assert check_memory(load_config(PROFILE_14B, ["rl.verl.max_token_len_per_gpu=16384", *extra]), {"rl"})


def test_a_larger_gpu_and_the_local_engine():
    cfg = load_config(PROFILE_14B, ["rl.verl.max_token_len_per_gpu=16384", "rl.verl.remove_padding=false",
                                    "cost.gpu_memory_gib=141"])
    assert check_memory(cfg, {"rl"}) is not None                  # an H200 holds it
    assert memory_estimate(load_config("tiny-cpu", [])) is None   # local engine: its own check (rl_engine.py)
