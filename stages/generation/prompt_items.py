"""Prompts for the tool rollout: token ids built with the tokenizer's chat template, length-checked."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from stages.core.errors import BadInputError
from stages.core.log import get_logger

log = get_logger(__name__)


class PromptRow(Protocol):
    """What a rollout needs of a task row (stages.data.RLRow has it): the runtime does not import the data stage."""

    index: int
    ability: str
    ground_truth: str
    question: str

    @property
    def messages(self) -> list[dict[str, str]]: ...


@dataclass(frozen=True)
class PromptItem:
    group: int              # GRPO group index within the batch
    prompt_ids: list[int]
    question: str
    ground_truth: str
    ability: str


class PromptTooLongError(BadInputError):
    pass


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """`apply_chat_template(messages, add_generation_prompt=True)` as a plain list of ids."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(i) for i in ids]


def build_prompt_items(rows: Sequence[PromptRow], tokenizer, max_prompt_length: int,
                       overflow: Literal["error", "truncate_left", "skip"] = "error",
                       source: str = "the RL data") -> list[PromptItem]:
    """One PromptItem per row (group = position in the returned list).

    A prompt longer than `max_prompt_length` tokens raises (naming the row), keeps its last
    `max_prompt_length` tokens (`truncate_left`: the chat header and the generation prompt stay at the end), or
    is left out with a warning (`skip`).
    """
    if max_prompt_length < 1:
        raise ValueError(f"max_prompt_length={max_prompt_length} must be >= 1 (rl.rollout.max_prompt_length)")
    items: list[PromptItem] = []
    skipped = 0
    for pos, row in enumerate(rows):
        ids = chat_prompt_ids(tokenizer, row.messages)
        if len(ids) > max_prompt_length:
            where = f"{source} row {row.index} (batch position {pos})"
            if overflow == "error":
                raise PromptTooLongError(
                    f"{where}: the prompt has {len(ids)} tokens, more than rl.rollout.max_prompt_length="
                    f"{max_prompt_length}; raise max_prompt_length, shorten the question, or set "
                    "rl.rollout.prompt_overflow to truncate_left or skip")
            if overflow == "skip":
                skipped += 1
                log.warning("%s: prompt of %d tokens exceeds max_prompt_length=%d; skipped", where, len(ids),
                            max_prompt_length)
                continue
            ids = ids[-max_prompt_length:]
        items.append(PromptItem(len(items), ids, row.question, row.ground_truth, row.ability))
    if rows and not items:
        raise PromptTooLongError(f"every one of the {len(rows)} prompts from {source} exceeds "
                                 f"max_prompt_length={max_prompt_length} ({skipped} skipped); raise it")
    return items
