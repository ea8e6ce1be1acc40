"""`model.toy_policy: tool_caller` (stages/bootstrap/toy_policy.py): the toy Qwen3 of a rehearsal, with the real
tokenizer, whose weights are a next-token table that spells a python or search call, then after the tool result
answers, calls again or stops: checked here by transformers' own sampling on the CPU, as vLLM will sample it."""

from __future__ import annotations

import math

import pytest
import torch

from stages.agent.protocol import parse_tool_call, render_result
from stages.bootstrap.toy_policy import MARGIN, PYTHON, SEARCH, THINK, script_tokens, successor_table

STOPS = ["</python>", "</search>"]


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """The toy exactly as the bootstrap writes it (build_toy_model), loaded back as the RL stage loads it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.bootstrap.toy import build_toy_model

    folder = tmp_path_factory.mktemp("toy") / "model"
    record = build_toy_model("Qwen3-14B", "Qwen/Qwen3-14B", folder, policy="tool_caller")
    return (AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(folder), record)


def sample(model, tokenizer, text: str, seed: int, tokens: int = 40) -> str:
    """Ancestral sampling at temperature 1 over the whole vocabulary (as the rollouts sample) up to a closing tool
    tag or EOS."""
    ids = tokenizer(text, return_tensors="pt").input_ids[0].tolist()
    generator, out = torch.Generator().manual_seed(seed), []
    with torch.no_grad():
        for _ in range(tokens):
            probs = torch.softmax(model(torch.tensor([ids + out])).logits[0, -1], -1)
            out.append(int(torch.multinomial(probs, 1, generator=generator)))
            text_out = tokenizer.decode(out)
            if out[-1] == tokenizer.eos_token_id or any(text_out.endswith(s) for s in STOPS):
                break
    return tokenizer.decode(out)


def test_the_table_is_a_distinct_spelling_of_each_piece_with_splits_that_sum_to_one(planted):
    _, tokenizer, record = planted
    pieces = script_tokens(tokenizer)
    assert tokenizer.decode(pieces["think"]) == THINK and tokenizer.decode(pieces["python"]) == PYTHON
    assert tokenizer.decode(pieces["search"]) == SEARCH
    inner = [t for name in ("think", "python", "search", "answer") for t in pieces[name] if t not in pieces["result_end"]]
    assert len(inner) == len(set(inner))                       # a bigram state has one successor
    table = successor_table(pieces)
    assert all(sum(nxt.values()) == pytest.approx(1.0) for nxt in table.values())
    assert record["policy"] == "tool_caller" and record["states"] == len(table)


def test_sampling_spells_a_tool_call_from_the_prompt(planted):
    model, tokenizer, _ = planted
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 6*7?"}], tokenize=False,
                                           add_generation_prompt=True)
    calls = [parse_tool_call(sample(model, tokenizer, prompt, seed)) for seed in range(8)]
    tools = [c.tool for c in calls if c is not None]
    # 8 draws of a 1/2 split, each spelled with probability ~0.994^15: both tools (a 1/128 chance of one only)
    assert len(tools) >= 7 and set(tools) == {"python", "search"}
    assert {c.argument for c in calls if c is not None and c.tool == "python"} == {"print(6*7)"}


def test_after_a_tool_result_the_toy_splits_between_stopping_answering_and_calling_again(planted):
    model, tokenizer, _ = planted
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "q"}], tokenize=False,
                                           add_generation_prompt=True)
    context = prompt + THINK + PYTHON + render_result("42")
    ids = tokenizer(context, return_tensors="pt").input_ids
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, -1], -1)
    top = logp.exp().topk(4)
    pieces = script_tokens(tokenizer)
    # 0.4 eos, 0.3 answer, 0.15 python, 0.15 search, times the ~99.4% the table keeps: logits MARGIN + ln(p / 0.4)
    # against 0 for the other rows, so the four hold e^MARGIN / 0.4 of the partition sum's mass
    kept = 1 / (1 + (model.config.vocab_size - 4) * math.exp(-MARGIN) * 0.4)
    assert top.indices.tolist() == [pieces["eos"][0], pieces["answer"][0], *top.indices.tolist()[2:]]
    assert set(top.indices.tolist()[2:]) == {pieces["python"][0], pieces["search"][0]}
    assert top.values.tolist() == pytest.approx([0.4 * kept, 0.3 * kept, 0.15 * kept, 0.15 * kept], rel=1e-3)
    entropy = float(-(logp.exp() * logp).sum())
    assert entropy > 1.2                                       # ~1.28 nats of the split: where branches are drawn
    texts = [sample(model, tokenizer, context, seed) for seed in range(12)]
    assert any(t.startswith("<answer>\\boxed{42}</answer>") for t in texts)
    assert any(t.startswith("<|im_end|>") for t in texts)
