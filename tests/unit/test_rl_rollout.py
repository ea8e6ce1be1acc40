"""Rollout driver logic on a scripted backend + toy tokenizer/toolbox (tests/unit/test_rl_rollout_fakes.py).

Lengths used below (ToyTokenizer: the model writes one id per character; `encode` maps each tag to one id):
    "<search>q</search>"   = 8 + 1 + 9 = 18 model tokens
    " <result>\\nR:q\\n</result>" encodes to " ", <result>, "\\n", "R", ":", "q", "\\n", </result> = 8 tokens
    "<answer>A</answer>" + EOS = 18 + 1 = 19 model tokens
"""

from __future__ import annotations

import pytest

from stages.core.config.rl import RolloutSection
from stages.core.rl_parquet import RLRow
from stages.generation.prompt_items import PromptItem, PromptTooLongError, build_prompt_items
from stages.rl.rollout import TreeRollout
from tests.unit.test_rl_rollout_fakes import (
    EOS,
    ScriptedBackend,
    ToyTokenizer,
    ToyToolBox,
)

SEARCH, ANSWER = "<search>q</search>", "<answer>A</answer>" + EOS


def cfg(**kw) -> RolloutSection:
    base = {"n": 1, "initial_rollouts": 1, "beam_size": 2, "call_limit": 3,
            "max_prompt_length": 64, "max_response_length": 200, "entropy_tokens": 20}
    return RolloutSection(**{**base, **kw})


def search_then_answer(e_search: float = 0.0, e_answer: float = 0.0):
    def policy(ctx: str, key) -> tuple[str, float]:
        return (SEARCH, e_search) if ctx.count("</result>") == 0 else (ANSWER, e_answer)
    return policy


def run(policy, section: RolloutSection, n_prompts: int = 1, seed: int = 0, algorithm: str = "grpo"):
    tok = ToyTokenizer()
    backend, box = ScriptedBackend(tok, policy), ToyToolBox()
    driver = TreeRollout(backend, box, tok, section, algorithm, seed=seed, show_progress=False)
    prompts = [PromptItem(g, tok.encode(f"user: question {g}\nassistant:"), f"question {g}", "A", "qa")
               for g in range(n_prompts)]
    return driver, driver.rollout(prompts), backend, box, tok


def test_loss_mask_and_tokens_kept_as_sampled():
    _, batch, _, box, tok = run(search_then_answer(), cfg())
    (t,) = batch.trajectories
    result_ids = tok.encode(" <result>\nR:q\n</result>", add_special_tokens=False)
    assert len(result_ids) == 8 and tok.bos_token_id not in result_ids          # standalone, no BOS
    expected = tok.chars("<search>q</search>") + result_ids + tok.chars("<answer>A</answer>") + [0]
    assert t.response_ids == expected                      # the stop tag as the model wrote it (char ids)
    assert tok.index["</search>"] not in t.response_ids[:18]  # a re-encode would have produced this id
    assert t.loss_mask == [1] * 18 + [0] * 8 + [1] * 19
    assert t.sample_logprobs == [-0.5] * 18 + [0.0] * 8 + [-0.5] * 19
    assert t.finish_reason == "eos" and t.tool_calls == {"search": 1} and t.tool_errors == 0
    assert t.response_text == "<search>q</search> <result>\nR:q\n</result><answer>A</answer>"
    assert box.batches == [[("search", "q")]]


def test_call_limit_appends_eos():
    always = lambda ctx, key: (SEARCH, 0.0)
    _, batch, _, box, _ = run(always, cfg(call_limit=2))
    (t,) = batch.trajectories
    # two calls run (18 + 8 each), the third stop gets EOS appended: 3 * 18 + 2 * 8 + 1 = 71 tokens
    assert len(t) == 71 and t.finish_reason == "tool_limit" and t.tool_calls == {"search": 2}
    assert t.response_ids[-1] == 0 and t.loss_mask[-1] == 1 and t.meta["forced_eos"] == 70
    assert len(box.batches) == 2


@pytest.mark.parametrize("segment", ["<search> </search>", "no opener</search>"])
def test_empty_or_unparsable_call_is_explicit(segment):
    _, batch, _, box, _ = run(lambda ctx, key: (segment, 0.0), cfg())
    (t,) = batch.trajectories
    assert t.finish_reason == "empty_call" and t.response_ids[-1] == 0 and t.loss_mask[-1] == 1
    assert len(t) == len(segment) + 1 and t.tool_calls == {} and box.batches == []
    assert batch.metrics["finish_empty_call"] == 1.0


def test_tool_error_counted():
    policy = lambda ctx, key: ("<search>fail</search>", 0.0) if "</result>" not in ctx else (ANSWER, 0.0)
    _, batch, _, _, _ = run(policy, cfg())
    assert batch.trajectories[0].tool_errors == 1 and batch.metrics["tool_errors"] == 1.0


def test_tool_tokens_count_against_budget():
    policy = lambda ctx, key: ("<search>long</search>", 0.0)
    _, batch, _, _, _ = run(policy, cfg(max_response_length=30))
    (t,) = batch.trajectories
    # 21 model tokens, then the 205-token result is cut to the 9 tokens of budget left
    assert len(t) == 30 and t.loss_mask == [1] * 21 + [0] * 9
    assert t.finish_reason == "length" and t.meta["result_truncated"] is True


def test_generation_stops_at_response_budget():
    _, batch, _, _, _ = run(lambda ctx, key: ("y" * 100, 0.0), cfg(max_response_length=40))
    (t,) = batch.trajectories
    assert len(t) == 40 and t.finish_reason == "length" and t.loss_mask == [1] * 40


def test_grpo_independent_roots_share_one_prompt_prefill():
    _, batch, backend, _, _ = run(search_then_answer(), cfg(n=3), n_prompts=2)
    assert [len(g.trajectories) for g in batch.groups] == [3, 3]
    assert [t.traj_id for t in batch.trajectories] == [0, 1, 2, 3, 4, 5]
    assert all(t.kind == "root" and t.parent_id is None for t in batch.trajectories)
    assert backend.prefilled == [("prompt", 0), ("prompt", 1)]
    prompt_len = len(batch.groups[0].trajectories[0].prompt_ids)
    assert backend.forks[:3] == [(("prompt", 0), 0, prompt_len), (("prompt", 0), 1, prompt_len),
                                 (("prompt", 0), 2, prompt_len)]
    assert backend.refreshed == 1 and backend.released[-1] is None   # caches dropped after the rollout


def test_arpo_paper_window_branches_after_post_result_segment():
    # tau = 0, w = 1: P = clip(dH); first segment H = 0 (baseline), post-result segment H = 1 -> dH = 1 -> P = 1
    section = cfg(n=4, initial_rollouts=2, branch_probability=0.0, entropy_weight=1.0,
                  entropy_window="paper", entropy_aggregation="mean")
    _, batch, backend, _, _ = run(search_then_answer(0.0, 1.0), section, algorithm="arpo")
    (g,) = batch.groups
    assert [t.kind for t in g.trajectories] == ["root", "root", "branch", "branch"]
    assert g.branches == 2 and g.fresh == 0 and g.initial_rollouts == 2
    # round 2: roots 0 and 1 each copy once (beam 2); the copy forks where the measured segment starts,
    # right after the result: 18 + 8 = 26, and re-samples the answer
    for child, parent in ((g.trajectories[2], g.trajectories[0]), (g.trajectories[3], g.trajectories[1])):
        assert child.parent_id == parent.traj_id and child.fork_at == 26
        assert child.response_ids[:26] == parent.response_ids[:26]
        assert child.loss_mask == parent.loss_mask and child.tool_calls == {"search": 1}
    prompt_len = len(g.trajectories[0].prompt_ids)
    assert (0, 2, prompt_len + 26) in backend.forks and (1, 3, prompt_len + 26) in backend.forks
    assert batch.metrics["rounds"] == 3.0


def test_arpo_reference_window_is_one_round_late_and_fresh_fills():
    # reference: the decision after call 1 uses the segment that ended in it = the baseline -> dH = 0 -> P = 0
    section = cfg(n=4, initial_rollouts=2, branch_probability=0.0, entropy_weight=1.0,
                  entropy_window="reference")
    _, batch, _, _, _ = run(search_then_answer(0.0, 1.0), section, algorithm="arpo")
    (g,) = batch.groups
    assert g.branches == 0 and g.fresh == 2
    assert [t.kind for t in g.trajectories] == ["root", "root", "fresh", "fresh"]
    # roots take 2 rounds; then one fresh root per round while none is active: 2 more rounds each
    assert batch.metrics["rounds"] == 6.0
    _, batch_all, _, _, _ = run(search_then_answer(0.0, 1.0), section.model_copy(update={"fresh_fill": "all"}),
                                algorithm="arpo")
    assert batch_all.groups[0].fresh == 2 and batch_all.metrics["rounds"] == 4.0


def test_reference_window_forks_after_result_with_tool_state_copied():
    section = cfg(n=3, initial_rollouts=1, branch_probability=1.0, entropy_weight=0.0,
                  entropy_window="reference", beam_size=3)
    _, batch, _, _, _ = run(search_then_answer(), section, algorithm="arpo")
    root, b1, b2 = batch.groups[0].trajectories
    assert (b1.parent_id, b1.fork_at, b2.parent_id, b2.fork_at) == (0, 26, 0, 26)   # after the 8 result tokens
    assert b1.loss_mask[18:26] == [0] * 8 and b1.response_ids[:26] == root.response_ids[:26]


def test_executed_tool_calls_count_a_shared_call_once():
    # the root searches once; both copies fork after its result and answer without a call of their own: every
    # trajectory carries 1 call (3 / 3 = 1 per trajectory), but the toolbox ran 1 call for the group (1 / 3)
    section = cfg(n=3, initial_rollouts=1, branch_probability=1.0, entropy_weight=0.0,
                  entropy_window="reference", beam_size=3)
    _, batch, _, box, _ = run(search_then_answer(), section, algorithm="arpo")
    assert [sum(t.tool_calls.values()) for t in batch.trajectories] == [1, 1, 1]
    assert [t.meta.get("inherited_tool_calls", 0) for t in batch.trajectories] == [0, 1, 1]
    assert len(box.batches) == 1 and batch.metrics["tool_calls"] == 3.0
    assert batch.metrics["tool_calls_executed"] == 1.0
    assert batch.metrics["tool_calls_executed_per_traj"] == pytest.approx(1 / 3)
    # GRPO: nothing is shared, so executed = carried (2 roots x 1 call)
    _, grpo, _, box, _ = run(search_then_answer(), cfg(n=2, initial_rollouts=2))
    assert grpo.metrics["tool_calls_executed"] == grpo.metrics["tool_calls"] == 2.0 == len(box.batches[0])


def test_exactly_n_and_shared_prefixes_under_random_branching():
    policy = lambda ctx, key: (SEARCH, 0.3) if ctx.count("</result>") < 2 else (ANSWER, 0.6)
    for seed in range(5):
        section = cfg(n=6, initial_rollouts=2, beam_size=3, branch_probability=0.5)
        _, batch, _, _, _ = run(policy, section, n_prompts=2, seed=seed, algorithm="arpo")
        for g in batch.groups:
            assert len(g.trajectories) == 6 and g.branches + g.fresh + 2 == 6
            by_id = {t.traj_id: t for t in g.trajectories}
            for t in g.trajectories:
                if t.kind == "branch":
                    assert by_id[t.parent_id].response_ids[:t.fork_at] == t.response_ids[:t.fork_at]


def test_initial_entropy_is_reset_every_rollout_call():
    calls = {"n": 0}

    def policy(ctx, key):
        return (SEARCH, 0.3 if calls["n"] == 0 else 0.7) if "</result>" not in ctx else (ANSWER, 0.5)

    driver, first, _, _, tok = run(policy, cfg(n=2, initial_rollouts=2), algorithm="arpo")
    calls["n"] = 1
    second = driver.rollout([PromptItem(0, tok.encode("user: q\nassistant:"), "q", "A", "qa")])
    # reference window, summed: the first segment is SEARCH, 18 tokens of 0.3 (then 0.7) -> 5.4 (then 12.6)
    assert [t.meta["h_initial"] for t in first.trajectories] == [pytest.approx(18 * 0.3)] * 2
    assert [t.meta["h_initial"] for t in second.trajectories] == [pytest.approx(18 * 0.7)] * 2


@pytest.mark.parametrize("window,agg,e_search,e_answer,h_root,h_tool,initial", [
    # paper window, mean: H_root = the probe generation's mean = e_search; H_tool = the post-result segment's mean
    # n = 4: floor(4 sigmoid(0.5 (H_root - H_tool))) + 1: sigmoid(-0.5) = 0.378 -> 1 + 1 = 2; sigmoid(0.5) -> 2 + 1 = 3
    ("paper", "mean", 0.0, 1.0, 0.0, 1.0, 2),
    ("paper", "mean", 1.0, 0.0, 1.0, 0.0, 3),
    # reference window, summed (the defaults): the probe generation is SEARCH (18 tokens) -> H_root = 18 e_search;
    # H_tool = mean over EVERY probe segment (as the reference): SEARCH 18 e_search and ANSWER+EOS 19 e_answer
    #   (0, 1): H_root 0, H_tool (0 + 19) / 2 = 9.5: sigmoid(-4.75) = 0.0086 -> floor(0.034) + 1 = 1
    #   (1, 0): H_root 18, H_tool (18 + 0) / 2 = 9: sigmoid(4.5) = 0.989 -> floor(3.96) + 1 = 4
    ("reference", "sum", 0.0, 1.0, 0.0, 9.5, 1),
    ("reference", "sum", 1.0, 0.0, 18.0, 9.0, 4),
])
def test_aepo_dynamic_initial_count(window, agg, e_search, e_answer, h_root, h_tool, initial):
    section = cfg(n=4, initial_rollouts=1, dynamic_rollouts=True, branch_probability=1.0, branch_penalty=0.05,
                  entropy_weight=0.0, entropy_window=window, entropy_aggregation=agg)
    _, batch, _, box, _ = run(search_then_answer(e_search, e_answer), section, algorithm="aepo")
    (g,) = batch.groups
    assert g.initial_rollouts == initial and len(g.trajectories) == 4
    assert g.meta == {"h_root": pytest.approx(h_root), "h_tool": pytest.approx(h_tool)}
    assert [t.traj_id for t in g.trajectories] == [0, 1, 2, 3]    # probe trajectories are not in the batch
    assert len(box.batches[0]) == 1                                # the probe's own tool call ran first


def test_reference_window_copies_take_their_own_baseline():
    # reference window (code-faithful): a copy made after call 1 has no baseline; its first segment after the fork
    # becomes it. Root: SEARCH (H 18 x 0.2 = 3.6), result, SEARCH again (18 x 0.5 = 9), ... The copy's first
    # own segment is the second SEARCH -> its h_initial = 9.0, not the parent's 3.6 (the paper window inherits).
    def policy(ctx, key):
        calls = ctx.count("</result>")
        return (SEARCH, 0.2 if calls == 0 else 0.5) if calls < 2 else (ANSWER, 0.1)

    for window, expected in (("reference", 18 * 0.5), ("paper", 18 * 0.2)):
        section = cfg(n=2, initial_rollouts=1, branch_probability=1.0, entropy_weight=0.0,
                      entropy_window=window)
        _, batch, _, _, _ = run(policy, section, algorithm="arpo")
        root, copy = batch.groups[0].trajectories
        assert copy.kind == "branch" and root.meta["h_initial"] == pytest.approx(18 * 0.2)
        assert copy.meta["h_initial"] == pytest.approx(expected), window


def test_prompt_validation_messages():
    tok = ToyTokenizer()
    driver = TreeRollout(ScriptedBackend(tok, search_then_answer()), ToyToolBox(), tok,
                           cfg(max_prompt_length=5), "grpo", show_progress=False)
    with pytest.raises(ValueError, match="max_prompt_length=5"):
        driver.rollout([PromptItem(0, list(range(2, 12)), "q", "A", "qa")])
    with pytest.raises(ValueError, match="unique"):
        driver.rollout([PromptItem(0, [2], "q", "A", "qa"), PromptItem(0, [3], "q", "A", "qa")])


def test_tool_call_opened_by_the_prompt_is_parsed():
    # a prompt ending in an assistant prefix that opens the call: the model only writes 'q</search>'
    tok = ToyTokenizer()
    policy = lambda ctx, key: ("q</search>", 0.0) if "</result>" not in ctx else (ANSWER, 0.0)
    backend, box = ScriptedBackend(tok, policy), ToyToolBox()
    driver = TreeRollout(backend, box, tok, cfg(), "grpo", show_progress=False)
    prompt = [tok.bos_token_id] + tok.encode("user: q\nassistant:<search>", add_special_tokens=False)
    batch = driver.rollout([PromptItem(0, prompt, "q", "A", "qa")])
    (t,) = batch.trajectories
    assert box.batches == [[("search", "q")]] and t.finish_reason == "eos" and t.tool_calls == {"search": 1}


def rl_row(index: int, question: str) -> RLRow:
    return RLRow(index, "toy", "qa", (("system", "sys"), ("user", question)), "A", question)


def test_build_prompt_items_applies_the_chat_template_and_prompt_overflow():
    tok = ToyTokenizer()
    # <bos> + "system: sys\n" (12) + "user: " (6) + question + "\n" (1) + "assistant:" (10) = 30 + len(question)
    rows = [rl_row(7, "ab"), rl_row(8, "x" * 40)]
    (short,) = build_prompt_items(rows[:1], tok, max_prompt_length=32)
    assert short.prompt_ids == tok.apply_chat_template(rows[0].messages) and len(short.prompt_ids) == 32
    assert (short.group, short.question, short.ground_truth, short.ability) == (0, "ab", "A", "qa")
    with pytest.raises(PromptTooLongError, match="row 8 .* 70 tokens, more than rl.rollout.max_prompt_length=32"):
        build_prompt_items(rows, tok, max_prompt_length=32)
    kept = build_prompt_items(rows, tok, max_prompt_length=32, overflow="skip")
    assert [p.question for p in kept] == ["ab"]
    cut = build_prompt_items(rows, tok, max_prompt_length=32, overflow="truncate_left")
    assert [p.group for p in cut] == [0, 1] and cut[1].prompt_ids == tok.apply_chat_template(rows[1].messages)[-32:]


@pytest.mark.parametrize("counter,kinds", [
    # consecutive_rounds (the reference): c counts rounds in a row that added copies or fresh roots.
    #   r1 root0 calls, c=0 -> copy 1 (c=1); r2 no copy (f=0), nothing added (c=0); r3 both copy (2, 3; c=1);
    #   r4 all four hit the call limit, a fresh root 4 (c=2); r5 blocked (c=0); r6 copy 5 (c=1); r7 nothing (c=0);
    #   r8 fresh 6 (c=1); r9 blocked (c=0); r10 copy 7 fills the budget of 8
    ("consecutive_rounds", ["root", "branch", "branch", "branch", "fresh", "branch", "fresh", "branch"]),
    # branches (the earlier reading): c = copies made this rollout, so after copy 1 the factor stays 0
    ("branches", ["root", "branch", "fresh", "fresh", "fresh", "fresh", "fresh", "fresh"]),
])
def test_aepo_penalty_counter_in_the_engine(counter, kinds):
    # penalty 1: factor max(0, 1 - c) is 1 at c = 0 and 0 from c = 1 on; tau = 1e-9, w = 0: a draw branches iff
    # the factor is 1 (score u * f >= 1e-9). Every trajectory searches until the call limit (3), then ends.
    section = cfg(n=8, initial_rollouts=1, beam_size=2, branch_probability=1e-9,
                  entropy_weight=0.0, branch_penalty=1.0, penalty_counter=counter, call_limit=3)
    _, batch, _, _, _ = run(lambda ctx, key: (SEARCH, 0.0), section, algorithm="aepo")
    (g,) = batch.groups
    assert [t.kind for t in g.trajectories] == kinds
    assert all(t.finish_reason == "tool_limit" for t in g.trajectories)
