"""`model.toy_policy: tool_caller`: a toy whose weights spell tool calls, so a rehearsal's RL step calls the python
sandbox and the search tool for real and draws branches after their results (a random-init toy never calls a tool).

The weights make the toy a next-token table (a bigram model): every layer's attention output projection (`o_proj`)
and MLP output projection (`down_proj`) are zero, so the residual stream at a position is the embedding of its
token, and the logits there are `lm_head @ norm(embed[token])`. Each token of the scripted text gets its own
direction of the embedding (one-hot), every other token shares one "default" direction; `lm_head` maps a direction
to its successors at logit MARGIN (each successor of a split equally), everything else stays at 0. With the real
vocabulary (~152k rows) the successor then takes ~99.4% of the mass per token: a trajectory spells its script
with high probability, and the rest of the vocabulary keeps enough entropy for the entropy bonus and the sampler
checks of a rehearsal to see the weights move.

The script (SCRIPT), from any token outside it (the end of the prompt, say):

    <think> plan</think>             -> 1/2 <python>print(6*7)</python>     (the sandbox prints 42)
                                     -> 1/2 <search>capital of France</search>
    after a tool result or </answer> -> 0.4 <eos>, 0.3 <answer>\\boxed{42}</answer>, 0.15 the python call again,
                                        0.15 the search again (a repeat: rejected by the toolbox)

A tool result always ends with the token `>` (`</result>`, stages/agent/protocol.py render_result), and in this
vocabulary every closing tag ends with it too: `>` is the one state "after a tool result or a closing tag" (a
closing tool tag stops the request, so only a result and `</answer>` are ever continued). No other scripted token
is `>` or appears twice: the opening tags are spelled with other tokens of the vocabulary (`<python>` as `<p`
`ython` `>p` ...), found by `spell`; the model's text is what the tree loop parses, whatever tokens spell it. The
split after a result is where a branch draw sees entropy.
"""

from __future__ import annotations

import math
from typing import Any

MARGIN = 17.0            # logit of a scripted successor over the rest of the vocabulary (0): ~99.4% of the mass
THINK = "<think> plan</think>"
PYTHON = "<python>print(6*7)</python>"
SEARCH = "<search>capital of France</search>"
ANSWER = "<answer>\\boxed{42}</answer>"
RESULT_END = ">"         # the last token of every tool result (render_result: "... </result>")
AFTER_RESULT = {"eos": 0.4, "answer": 0.3, "python": 0.15, "search": 0.15}


class PlantError(ValueError):
    """The tokenizer cannot spell the script with distinct tokens (a tokenizer the table was not made for)."""


def _vocabulary(tokenizer: Any) -> dict[str, int]:
    """Each token's text -> its id (the smallest id for a text; tokens that decode to partial bytes left out)."""
    out: dict[str, int] = {}
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i])
        if text and "\ufffd" not in text and text not in out:
            out[text] = i
    return out


def spell(text: str, vocabulary: dict[str, int], banned: set[int]) -> list[int]:
    """Tokens whose texts concatenate to `text`, none in `banned` and none twice (a bigram state must have one
    successor): the first such spelling found trying longer tokens first; PlantError when there is none."""
    longest = max(len(t) for t in vocabulary)
    def search(start: int, used: list[int]) -> list[int] | None:
        if start == len(text):
            return used
        for end in range(min(len(text), start + longest), start, -1):
            token = vocabulary.get(text[start:end])
            if token is None or token in banned or token in used:
                continue
            found = search(end, [*used, token])
            if found is not None:
                return found
        return None

    found = search(0, [])
    if found is None:
        raise PlantError(f"the tokenizer cannot spell {text!r} with distinct tokens outside {sorted(banned)}")
    return found


def script_tokens(tokenizer: Any) -> dict[str, list[int]]:
    """The ids of each scripted piece, pairwise distinct (think, python, search, answer), and the special ones."""
    vocabulary = _vocabulary(tokenizer)
    result_end = tokenizer.encode(RESULT_END, add_special_tokens=False)
    if len(result_end) != 1 or tokenizer.encode(" <result>\nx\n</result>", add_special_tokens=False)[-1:] != result_end:
        raise PlantError("this tokenizer does not end a tool result with one '>' token")
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    banned = {*result_end, eos, *tokenizer.encode("\n", add_special_tokens=False)}
    pieces: dict[str, list[int]] = {}
    for name, text in (("think", THINK), ("python", PYTHON), ("search", SEARCH), ("answer", ANSWER)):
        closing = name != "think"   # a closing tag's `>` is the result's: the same state (see above)
        pieces[name] = spell(text[:-1] if closing else text, vocabulary, banned) + (result_end if closing else [])
        banned |= set(pieces[name]) - set(result_end)
    pieces["result_end"], pieces["eos"] = result_end, [eos]
    return pieces


def successor_table(pieces: dict[str, list[int]]) -> dict[int | None, dict[int, float]]:
    """state token (None = every token outside the script) -> {successor: probability among the successors}."""
    table: dict[int | None, dict[int, float]] = {None: {pieces["think"][0]: 1.0}}
    for name in ("think", "python", "search", "answer"):
        ids = pieces[name]
        for a, b in zip(ids, ids[1:]):
            table[a] = {b: 1.0}
    table[pieces["think"][-1]] = {pieces["python"][0]: 0.5, pieces["search"][0]: 0.5}
    # after a tool result or an answer (both end with the result's `>`)
    table[pieces["result_end"][0]] = {pieces["eos"][0]: AFTER_RESULT["eos"],
                                      **{pieces[name][0]: AFTER_RESULT[name] for name in ("answer", "python", "search")}}
    return table


def plant_tool_caller(model: Any, tokenizer: Any) -> dict[str, Any]:
    """Overwrite `model`'s weights (in place) with the script's next-token table; returns what toy.json records."""
    import torch

    pieces = script_tokens(tokenizer)
    table = successor_table(pieces)
    states = [None, *sorted(s for s in table if s is not None)]
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    hidden = embed.shape[1]
    if len(states) > hidden:
        raise PlantError(f"the script has {len(states)} states, more than the toy's width {hidden}")
    if embed.data_ptr() == head.data_ptr():
        raise PlantError("a tied toy cannot be a next-token table (its head is its embedding); use an untied model")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed.zero_()
        head.zero_()
        scale = math.sqrt(hidden)   # the final RMSNorm turns a one-hot row into sqrt(width) on its direction
        embed[:, 0] = 1.0           # the default direction: every token outside the script
        for direction, state in enumerate(states):
            if state is not None:
                embed[state].zero_()
                embed[state, direction] = 1.0
            for successor, p in table[state].items():
                head[successor, direction] = (MARGIN + math.log(p / max(table[state].values()))) / scale
        model.model.norm.weight.fill_(1.0)
    text = {name: tokenizer.decode(ids) for name, ids in pieces.items() if name in ("python", "search", "answer")}
    return {"policy": "tool_caller", "margin": MARGIN, "states": len(states), "script": text,
            "note": "a next-token table that calls the python and search tools (stages/bootstrap/toy_policy.py)"}
