"""Seam checks: where SFT (LLaMA-Factory's template), RL and evaluation (the tokenizer's chat template) meet.

Each check takes a tokenizer and plain values, returns a `SeamResult`, and on a problem says what is wrong and the
setting that fixes it (docs/seams.md): `template` (SFT prompt ids == chat-template prompt ids, system prompt
included), `thinking` (an empty `<think>` block SFT adds that the RL/eval prompt leaves to the model), `tags` (tool
tags and stop strings survive encode/decode and are found by the stop matcher), `special_ids` (eos ends a turn,
pad is not a prompt token) and `lengths` (prompt limits and context budgets within the model's
max_position_embeddings). `raise_failures` turns failed checks into one input error. The pre-flight that finds
the tokenizer of a profile and runs these is `stages/sft/seam_preflight.py` (one check of the run's pre-flight,
stages.core.preflight).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from stages.agent.stops import StopMatcher
from stages.core.errors import BadInputError
from stages.generation.prompt_items import chat_prompt_ids

Messages = list[dict[str, str]]
# A probe response with the protocol's <think> tags that LLaMA-Factory's ReasoningTemplate leaves as written (its
# strip pattern needs "<think>\n...\n</think>\n\n"): the prompt ids it gives depend on the template alone.
PROMPT_PROBE_TARGET = "<think> plan </think>\n<answer>The answer is \\boxed{5}</answer>"
LF_KEYS = ("enable_thinking", "preserve_thinking", "default_system", "tool_format")


class SeamError(BadInputError):
    """SFT, RL and evaluation would see the model through different token ids."""


@dataclass(frozen=True)
class SeamResult:
    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class SeamInputs:
    """What the checks compare. template: LLaMA-Factory's template name (None: no SFT, template checks skipped);
    lf_args: its data arguments from sft.extra_args (enable_thinking, default_system...); prompts: (label,
    messages) of the profile's prompts; targets: SFT responses (assistant text); prompt_limits: config key ->
    token limit each prompt must fit; budgets: what a sequence may reach (e.g. "rl prompt + response") -> tokens;
    max_positions: the model's max_position_embeddings (None: unknown, budgets skipped)."""

    template: str | None
    prompts: tuple[tuple[str, Messages], ...]
    targets: tuple[str, ...] = ()
    lf_args: Mapping[str, Any] = field(default_factory=dict)
    tags: tuple[str, ...] = ()
    stops: tuple[str, ...] = ()
    prompt_limits: Mapping[str, int] = field(default_factory=dict)
    budgets: Mapping[str, int] = field(default_factory=dict)
    max_positions: int | None = None
    generation_eos: tuple[int, ...] = ()


def lf_template(name: str, tokenizer, lf_args: Mapping[str, Any] | None = None):
    """(template, tokenizer) as LLaMA-Factory's SFT gets them: `get_template_and_fix_tokenizer` on a copy of the
    tokenizer (it replaces eos with the template's stop word). The shared template object's thinking flags are put
    back afterwards."""
    from llamafactory.data.template import TEMPLATES, get_template_and_fix_tokenizer

    if name not in TEMPLATES:
        raise SeamError(f"sft.template / model.template={name!r} is not a LLaMA-Factory template; name one of "
                        "llamafactory.data.template.TEMPLATES (e.g. qwen for Qwen2.5, qwen3 / qwen3_nothink for Qwen3)")
    args = {"enable_thinking": True, "preserve_thinking": False, "default_system": None, "tool_format": None}
    args |= {k: v for k, v in (lf_args or {}).items() if k in LF_KEYS}
    shared = TEMPLATES[name]
    saved = {k: getattr(shared, k) for k in ("enable_thinking", "preserve_thinking", "default_system")
             if hasattr(shared, k)}
    fixed = copy.deepcopy(tokenizer)
    try:
        template = copy.deepcopy(get_template_and_fix_tokenizer(
            fixed, SimpleNamespace(template=name, train_on_prompt=False, **args)))
    finally:
        for key, value in saved.items():
            setattr(shared, key, value)
    return template, fixed


def lf_encode(template, tokenizer, messages: Messages, target: str) -> tuple[list[int], list[int]]:
    """LLaMA-Factory's (prompt ids, response ids) of one SFT row: [system?, user] + the assistant's target."""
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    turns = [m for m in messages if m["role"] != "system"] + [{"role": "assistant", "content": target}]
    return template.encode_oneturn(tokenizer, turns, system)


def _first_diff(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def matching_templates(tokenizer, prompts: Iterable[tuple[str, Messages]], near: str = "", limit: int = 5
                       ) -> list[str]:
    """LLaMA-Factory templates whose prompt ids equal the chat template's for every prompt (for the fix line),
    those sharing their first letters with `near` (the configured name: the same family) first."""
    from llamafactory.data.template import TEMPLATES

    wanted = [(messages, chat_prompt_ids(tokenizer, messages)) for _, messages in prompts]
    found = []
    for name, template in TEMPLATES.items():
        try:
            if all(lf_encode(template, tokenizer, m, PROMPT_PROBE_TARGET)[0] == ids for m, ids in wanted):
                found.append(name)
        except Exception:  # noqa: BLE001 (a template for another modality or tool format: not a candidate)
            continue
    family = near[:4]
    return sorted(found, key=lambda name: (not (family and name.startswith(family)), len(name)))[:limit]


def check_template(template, fixed, tokenizer, name: str, prompts: Sequence[tuple[str, Messages]]) -> SeamResult:
    """SFT's prompt ids (LLaMA-Factory's template `name`) == the RL/eval prompt ids (the tokenizer's chat template,
    `apply_chat_template(add_generation_prompt=True)`) for every probe prompt, system prompt included."""
    for label, messages in prompts:
        sft, chat = lf_encode(template, fixed, messages, PROMPT_PROBE_TARGET)[0], chat_prompt_ids(tokenizer, messages)
        if sft == chat:
            continue
        at = _first_diff(sft, chat)
        fits = [t for t in matching_templates(tokenizer, prompts, name) if t != name]
        default = getattr(template, "default_system", "")
        why = (f"; template {name!r} inserts its default system prompt {default!r} where the chat template has none"
               if default and default in fixed.decode(sft) and default not in tokenizer.decode(chat) else "")
        return SeamResult("template", False, (
            f"SFT and RL/eval see different prompt token ids for {label}: LLaMA-Factory's template {name!r} gives "
            f"{len(sft)} ids, the tokenizer's chat template {len(chat)}; first difference at id {at}: SFT "
            f"{fixed.decode(sft[at:at + 24])!r} vs chat template {tokenizer.decode(chat[at:at + 24])!r}{why}. Fix: "
            f"set sft.template (or model.template) to the LLaMA-Factory template of this tokenizer"
            f"{' (matching here: ' + ', '.join(fits) + ')' if fits else ''}, or sft.extra_args.default_system"))
    return SeamResult("template", True, f"template {name!r} == chat template on {len(prompts)} prompt(s)")


def check_thinking(template, fixed, tokenizer, name: str, messages: Messages, targets: Sequence[str]) -> SeamResult:
    """SFT targets keep what the RL/eval prompt leaves to the model: no empty `<think>` block added to a response
    that has none (ReasoningTemplate, enable_thinking true), none put into the SFT prompt and no reasoning removed
    (enable_thinking false), since the chat-template prompt ends at the assistant header."""
    thought = getattr(template, "thought_words", None)
    if thought is None or not hasattr(template, "remove_thought") or not targets:
        return SeamResult("thinking", True, f"template {name!r} adds no thinking block")
    empty = template.get_thought_word_ids(fixed)
    chat = chat_prompt_ids(tokenizer, messages)
    nothink = f"{name}_nothink"
    for target in targets:
        prompt, response = lf_encode(template, fixed, messages, target)
        if prompt != chat and prompt[:len(chat)] == chat:
            return SeamResult("thinking", False, (
                f"SFT with template {name!r} and sft.extra_args.enable_thinking=false ends every prompt with "
                f"{fixed.decode(prompt[len(chat):])!r} and removes <think> reasoning from the targets, while the "
                "RL/eval prompt (the chat template) ends at the assistant header and leaves thinking to the model. "
                f"Fix: drop sft.extra_args.enable_thinking (LLaMA-Factory's default true) or set sft.template="
                f"{nothink}"))
        if response[:len(empty)] == empty and "<think>" not in target:
            return SeamResult("thinking", False, (
                f"SFT with template {name!r} (LLaMA-Factory ReasoningTemplate, enable_thinking true) trains a "
                f"target without <think> as {fixed.decode(empty)!r} + target: the model learns to close an empty "
                "<think> block, which the RL/eval prompt (the chat template) leaves to the model. Fix: set "
                f"sft.template={nothink} (targets trained as written), or write the reasoning of each SFT target "
                "in <think>...</think>"))
    return SeamResult("thinking", True, f"template {name!r}: {len(targets)} target(s) trained as written")


def check_tags(tokenizer, tags: Sequence[str], stops: Sequence[str]) -> SeamResult:
    """Every tag and stop string decodes back to itself, alone and in running text, and the stop matcher generation
    uses (`StopMatcher`) finds each stop string at the end of generated ids."""
    for text in dict.fromkeys((*tags, *stops)):
        for probe in (text, f"The plan is set.\n{text}\n", f" x{text} "):
            ids = tokenizer.encode(probe, add_special_tokens=False)
            back = tokenizer.decode(ids, skip_special_tokens=False)
            if back != probe:
                return SeamResult("tags", False, (
                    f"the tokenizer does not give back {text!r}: {probe!r} decodes to {back!r}, so the agent "
                    "protocol and the stop rule would miss it. Fix: use the model's own tokenizer (model.path) "
                    "without a normalizer or added token that rewrites text, or rename the tag"))
    for stop in stops:
        ids = tokenizer.encode(f"<think> ok </think>\n<search> capital of France {stop}", add_special_tokens=False)
        if StopMatcher(tokenizer, tuple(stops)).match(ids) != stop:
            return SeamResult("tags", False, (
                f"generation's stop matcher does not find the stop string {stop!r} at the end of generated ids; "
                "fix: use the model's own tokenizer (model.path)"))
    return SeamResult("tags", True, f"{len(set(tags) | set(stops))} tag(s) and stop string(s) round-trip")


def check_special_ids(fixed, messages: Messages, stop_words: Sequence[str],
                      generation_eos: Iterable[int] = ()) -> SeamResult:
    """eos is set and is the token that ends an assistant turn (the template's stop word), so generation stops at
    the end of a turn; pad is set (else eos stands in) and is no token of the prompt other than eos, so padding
    never hides a prompt token. pad == eos is allowed: masks come from lengths (the tiny model has it)."""
    eos = {int(fixed.eos_token_id)} if fixed.eos_token_id is not None else set()
    eos |= {int(i) for i in generation_eos}
    if not eos:
        return SeamResult("special_ids", False, "the tokenizer has no eos token and the template names no stop "
                          "word; fix: set model.eos_token (or the tokenizer's eos_token) to the end-of-turn token")
    for word in stop_words:
        ids = fixed.encode(word, add_special_tokens=False)
        if len(ids) != 1 or ids[0] not in eos:
            return SeamResult("special_ids", False, (
                f"the turn ends with {word!r} (ids {ids}) but generation stops at eos ids {sorted(eos)} "
                f"({fixed.decode(sorted(eos))!r}): a reply would run past its turn. Fix: set the tokenizer's "
                f"eos_token to {word!r} (model.eos_token), or use the template of this model family"))
    pad = fixed.pad_token_id
    prompt = set(chat_prompt_ids(fixed, messages))
    if pad is not None and pad in prompt and pad not in eos:
        return SeamResult("special_ids", False, (
            f"the pad id {pad} ({fixed.convert_ids_to_tokens(pad)!r}) occurs in every prompt, so padding would "
            "hide prompt tokens. Fix: set the tokenizer's pad_token to a token prompts do not use (e.g. "
            "<|endoftext|> for Qwen) or to the eos token"))
    return SeamResult("special_ids", True, f"eos {sorted(eos)}, pad {pad if pad is not None else 'eos'}")


def check_lengths(tokenizer, prompts: Sequence[tuple[str, Messages]], prompt_limits: Mapping[str, int],
                  budgets: Mapping[str, int], max_positions: int | None) -> SeamResult:
    """Each probe prompt fits every prompt limit, and each budget fits the model's max_position_embeddings."""
    for label, messages in prompts:
        n = len(chat_prompt_ids(tokenizer, messages))
        for key, limit in prompt_limits.items():
            if n > limit:
                return SeamResult("lengths", False, (
                    f"{label} is {n} tokens, more than {key}={limit}: every prompt would fail or be cut. Fix: "
                    f"raise {key} to at least {n} plus the longest question, or use a shorter "
                    "agent.prompt_template"))
    for what, tokens in budgets.items():
        if max_positions is not None and tokens > max_positions:
            return SeamResult("lengths", False, (
                f"{what} = {tokens} tokens, more than the model's max_position_embeddings={max_positions} "
                f"(config.json): positions past it were never trained. Fix: lower {what} to at most "
                f"{max_positions}"))
    known = "unknown (no config.json)" if max_positions is None else str(max_positions)
    return SeamResult("lengths", True, f"prompts within {dict(prompt_limits)}; max_position_embeddings {known}")


def run_seam_checks(tokenizer, inputs: SeamInputs) -> list[SeamResult]:
    """Every seam check on one tokenizer (the base model's; SFT's copy gets LLaMA-Factory's fixes)."""
    results = []
    main = inputs.prompts[0][1] if inputs.prompts else [{"role": "user", "content": "What is 2 + 3?"}]
    fixed, stop_words = tokenizer, ()
    if inputs.template:
        template, fixed = lf_template(inputs.template, tokenizer, inputs.lf_args)
        stop_words = tuple(template.stop_words[:1]) if getattr(template, "replace_eos", False) else ()
        results.append(check_template(template, fixed, tokenizer, inputs.template, inputs.prompts))
        results.append(check_thinking(template, fixed, tokenizer, inputs.template, main, inputs.targets))
    results.append(check_tags(tokenizer, inputs.tags, inputs.stops))
    results.append(check_special_ids(fixed, main, stop_words, inputs.generation_eos))
    results.append(check_lengths(tokenizer, inputs.prompts, inputs.prompt_limits, inputs.budgets,
                                 inputs.max_positions))
    return results


def raise_failures(results: Iterable[SeamResult]) -> None:
    failed = [r for r in results if not r.ok]
    if failed:
        raise SeamError("seam check failed: " + " | ".join(f"[{r.name}] {r.detail}" for r in failed))
