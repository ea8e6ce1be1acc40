"""Prefix KV reuse in the cpu engine changes speed, never tokens: greedy outputs with the prefix cache on
equal those with it off, for a batch sharing the TIR system prompt and for an agent-style continuation."""

from __future__ import annotations

import pytest
import torch

from stages.agent.prompts import build_messages
from stages.eval.cpu_engine import Engine, Row, SamplingParams
from stages.eval.prefix_cache import common_prefix_length

pytestmark = pytest.mark.integration
QUESTIONS = ["What is the sum of the decimal digits of 4^168?", "In which province was Motun Vavox born?",
             "What is 2+3?"]


def test_common_prefix_length() -> None:
    assert common_prefix_length([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0


def run_all(engine: Engine) -> list[str]:
    prompts = [engine.chat_prompt(build_messages(q)) for q in QUESTIONS]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.1)
    batch = [r.text for r in engine.generate([Row(p, greedy) for p in prompts])]
    alone = engine.generate([Row(prompts[0], greedy)])[0].text
    continued = engine.generate([Row(prompts[0] + engine.encode(alone), greedy)])[0].text  # the loop's next call
    return [*batch, alone, continued]


def test_prefix_reuse_keeps_greedy_outputs(tiny_model) -> None:
    torch.set_num_threads(1)
    model_engine = Engine.load(tiny_model.path, prefix_cache_entries=0)
    off = run_all(model_engine)
    model_engine.prefix.max_entries = 8
    on = run_all(model_engine)
    assert on == off
    stats = model_engine.prefix.stats()
    prompts = [model_engine.chat_prompt(build_messages(q)) for q in QUESTIONS]
    head = min(common_prefix_length(prompts[0], p) for p in prompts)      # template + system prompt + "<user>"
    first, answer = len(prompts[0]), len(model_engine.encode(on[3]))
    assert head > 200                                                      # the TIR system prompt is long
    # batch: the shared head is computed once (no entry yet). alone: the head is reused from that entry and the
    # rest of prompt 0 but its last token computed. continued: all of prompt 0 but its last token is reused.
    assert stats["prefix_hits"] == 2
    assert stats["prefix_reused_tokens"] == head + (first - 1)
    assert stats["prefix_computed_tokens"] == head + (first - 1 - head) + answer
