"""The tree rollout on the real tiny model, the real toolbox (local BM25 search over the generated corpus).

The untrained 135M model rarely opens a tool call by itself, so each prompt ends with an assistant prefix that
opens a search ("...</think>\\n<search>"); the model writes the query and closes the tag itself in most samples
(greedy: always, for these questions), which is all branching needs: tool results to branch after.
"""

from __future__ import annotations

import pytest
import torch

from stages.core.config.agent import AgentSection, SearchSection
from stages.core.config.rl import RolloutSection
from stages.core.rl_parquet import read_rl_parquet
from stages.generation import load_backend
from stages.generation.prompt_items import PromptItem, build_prompt_items
from stages.rl.rollout import TreeRollout

pytestmark = pytest.mark.integration

PRIMER = "<think>I will search for it.</think>\n<search>"


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model.path, dtype=torch.float32, attn_implementation="sdpa")
    return model, tok


@pytest.fixture(scope="module")
def toolbox(synthetic_data, tmp_path_factory):
    from stages.agent.toolbox import ToolBox

    agent = AgentSection(search=SearchSection(top_k=1, max_chars_per_passage=120))  # short results: ~40 tokens
    box = ToolBox.from_config(agent, str(synthetic_data.file("corpus")),
                              str(tmp_path_factory.mktemp("tool-cache")))
    yield box
    close = getattr(box, "close", None)
    if callable(close):
        close()


@pytest.fixture(scope="module")
def prompts(synthetic_data, model_and_tokenizer) -> list[PromptItem]:
    _, tok = model_and_tokenizer
    rows = [r for r in read_rl_parquet(synthetic_data.file("rl_train")) if r.ability == "qa"][:2]
    items = build_prompt_items(rows, tok, max_prompt_length=1024)
    primer = tok.encode(PRIMER, add_special_tokens=False)
    return [PromptItem(p.group, p.prompt_ids + primer, p.question, p.ground_truth, p.ability) for p in items]


def section(**kw) -> RolloutSection:
    base = {"n": 4, "initial_rollouts": 2, "beam_size": 2, "call_limit": 2,
            "max_prompt_length": 1024, "max_response_length": 112, "temperature": 1.0, "entropy_tokens": 8}
    return RolloutSection(**{**base, **kw})


def check_groups(batch, n: int) -> int:
    """Exactly n per group; every branch is token-identical to its parent up to fork_at. Returns #branches."""
    branches = 0
    for g in batch.groups:
        assert len(g.trajectories) == n
        by_id = {t.traj_id: t for t in g.trajectories}
        for t in g.trajectories:
            assert len(t.response_ids) == len(t.loss_mask) == len(t.sample_logprobs) == len(t.entropies) <= 112
            if t.kind != "branch":
                continue
            branches += 1
            parent = by_id[t.parent_id]
            assert t.fork_at > 0
            assert t.response_ids[:t.fork_at] == parent.response_ids[:t.fork_at]
            assert t.loss_mask[:t.fork_at] == parent.loss_mask[:t.fork_at]
            assert t.sample_logprobs[:t.fork_at] == parent.sample_logprobs[:t.fork_at]
            assert 0 in t.loss_mask[:t.fork_at]        # paper window: the fork follows a tool result
    return branches


def test_arpo_groups_and_shared_prefixes(model_and_tokenizer, toolbox, prompts):
    model, tok = model_and_tokenizer
    backend = load_backend("transformers", model, tok)
    # tau = 1: every candidate copies while budget remains
    driver = TreeRollout(backend, toolbox, tok, section(branch_probability=1.0, entropy_weight=0.0), "arpo", seed=0)
    batch = driver.rollout(prompts)
    assert check_groups(batch, 4) > 0
    assert batch.metrics["tool_calls"] > 0 and batch.metrics["branches"] == sum(g.branches for g in batch.groups)
    for t in batch.trajectories:  # tool results are masked and come back as ' <result>\n...\n</result>' text
        if 0 in t.loss_mask:
            start = t.loss_mask.index(0)
            assert tok.decode(t.response_ids[start:start + 3]).startswith(" <result>")


def test_aepo_dynamic_groups(model_and_tokenizer, toolbox, prompts):
    model, tok = model_and_tokenizer
    backend = load_backend("transformers", model, tok)
    cfg = section(dynamic_rollouts=True, branch_penalty=0.05, branch_probability=0.0, probe_tokens=16)
    batch = TreeRollout(backend, toolbox, tok, cfg, "aepo", seed=1).rollout(prompts)
    check_groups(batch, 4)
    for g in batch.groups:
        assert set(g.meta) == {"h_root", "h_tool"} and 1 <= g.initial_rollouts <= 4
        assert g.initial_rollouts + g.branches + g.fresh == 4
    assert batch.metrics["branches"] > 0  # tau = 0: every candidate branches while budget remains


def test_kv_reuse_rollout_equals_reprefill_and_costs_less(model_and_tokenizer, toolbox, prompts):
    model, tok = model_and_tokenizer
    cfg = section(temperature=0.0, branch_probability=1.0, entropy_weight=0.0)
    batches = {}
    for reuse in (True, False):
        backend = load_backend("transformers", model, tok, kv_reuse=reuse)
        batches[reuse] = TreeRollout(backend, toolbox, tok, cfg, "arpo", seed=0).rollout(prompts[:1])
    fast, slow = batches[True], batches[False]
    assert fast.metrics["branches"] > 0 and fast.metrics["tool_calls"] > 0
    assert [t.response_ids for t in fast.trajectories] == [t.response_ids for t in slow.trajectories]
    assert [(t.parent_id, t.fork_at) for t in fast.trajectories] == [(t.parent_id, t.fork_at)
                                                                       for t in slow.trajectories]
    assert fast.metrics["decode_tokens"] == slow.metrics["decode_tokens"]
    assert fast.metrics["forward_tokens"] < slow.metrics["forward_tokens"]


def test_early_tools_rollout_equals_rounds_on_the_tiny_model(model_and_tokenizer, toolbox, prompts):
    """The transformers backend answers each row as it finishes decoding (generate_iter): its tool call runs while
    the other rows decode, and the sampled batch is the same, bit for bit (tokens, log-probs, masks, forks, draws).
    The paper window: its forks at a segment's start need the CallState from before the parent's call."""
    import dataclasses

    model, tok = model_and_tokenizer
    cfg = section(branch_probability=1.0, entropy_weight=0.0, entropy_window="paper")
    batches = {}
    for schedule in ("rounds", "early_tools"):
        backend = load_backend("transformers", model, tok)
        batches[schedule] = TreeRollout(backend, toolbox, tok, cfg.model_copy(update={"schedule": schedule}),
                                        "arpo", seed=3).rollout(prompts[:1])
    rounds, early = batches["rounds"], batches["early_tools"]
    assert rounds.metrics["tool_calls"] > 0 and rounds.metrics["branches"] > 0
    assert [dataclasses.asdict(t) for t in early.trajectories] == [dataclasses.asdict(t) for t in rounds.trajectories]
    assert [(g.branches, g.fresh) for g in early.groups] == [(g.branches, g.fresh) for g in rounds.groups]


def test_async_rollout_on_the_tiny_model(model_and_tokenizer, toolbox, prompts):
    """`async` on the transformers backend (per-row generators from counter seeds, run-ahead trajectories, forks
    from round-boundary snapshots): every group ends with n well-formed trajectories, branches share their parent's
    tokens up to the fork. Which requests share a batch depends on timing, and batching changes the floating-point
    results, so the trees are compared with `rounds` in distribution only (the scripted backend's parity tests
    compare them bit for bit: tests/unit/test_async_schedule.py)."""
    model, tok = model_and_tokenizer
    cfg = section(branch_probability=1.0, entropy_weight=0.0, entropy_window="paper", schedule="async")
    backend = load_backend("transformers", model, tok)
    batch = TreeRollout(backend, toolbox, tok, cfg, "arpo", seed=3).rollout(prompts)
    assert check_groups(batch, 4) > 0 and batch.metrics["tool_calls"] > 0
    assert any(t.meta.get("draws") for t in batch.trajectories)   # the draws reached the live trajectories
