"""Token-id parity of the prompt template across environments (stage start of the verl engine).

The SFT stage (project venv, transformers 5.6) taught the policy one rendering of the chat template; the RL stage
runs in verl's environment (transformers 5.9), and vLLM serving in its own. A tokenizer or template change between
transformers versions would silently train on other ids than the model was fine-tuned and is served on. The
verl launcher renders the same probe prompts in its own interpreter and in the parent interpreter that started
it (ARPO_PARENT_PYTHON, set by stages.core.isolate) and refuses to start when the ids differ.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from stages.core.log import get_logger
from stages.generation.prompt_items import chat_prompt_ids

log = get_logger(__name__)
PARENT_PYTHON_ENV = "ARPO_PARENT_PYTHON"
PROBE_ASSISTANT = "<think>check</think>\n<search> a query </search>"  # a TIR tag run, tokenized standalone


class TokenParityError(RuntimeError):
    pass


def template_token_ids(tokenizer_dir: str, conversations: list[list[dict[str, str]]]) -> dict[str, list[list[int]]]:
    """Prompt ids (chat template with generation prompt) of each conversation, plus the ids of a TIR snippet."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return {"prompts": [chat_prompt_ids(tokenizer, messages) for messages in conversations],
            "tir": [tokenizer.encode(PROBE_ASSISTANT, add_special_tokens=False)]}


def check_parity(tokenizer_dir: str, conversations: list[list[dict[str, str]]],
                 other_python: str | None = None) -> dict:
    """Compare this interpreter's ids with `other_python`'s (default: $ARPO_PARENT_PYTHON). Returns a report;
    raises TokenParityError naming the first differing prompt."""
    other = other_python or os.environ.get(PARENT_PYTHON_ENV)
    here = template_token_ids(tokenizer_dir, conversations)
    if not other or Path(other).absolute() == Path(sys.executable).absolute():  # venv pythons are symlinks
        return {"checked": False, "reason": "no other interpreter (the stage runs in the parent's)"}
    from stages.core.isolate import call_in_interpreter

    there = call_in_interpreter(other, "stages.rl.verl.parity:template_token_ids",
                                {"tokenizer_dir": tokenizer_dir, "conversations": conversations})
    for kind in ("prompts", "tir"):
        for i, (a, b) in enumerate(zip(here[kind], there[kind])):
            if a != b:
                at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                raise TokenParityError(
                    f"{kind} {i}: the token ids of the prompt template differ between {sys.executable} and "
                    f"{other} from position {at} ({a[at:at + 5]} vs {b[at:at + 5]}); the tokenizer or chat "
                    "template behaves differently across the transformers versions of the two environments. "
                    "Pin the same tokenizer files (model folder) or align transformers before training")
    log.info("prompt-template token ids agree between %s and %s (%d prompts)", sys.executable, other,
             len(conversations))
    return {"checked": True, "other": other, "prompts": len(conversations)}
