"""Chat messages for the TIR protocol from the prompt templates in configs/templates/.

Templates (file stems): `tir_search_python` (the reference system prompt, docs/reference.md "System prompt"),
`tir_search_python_zh` (the reference's Chinese prompt `code_search_cn`, which its Chinese inference script uses
for xbench), `tir_search` (search only), `tir_python` (python only), `no_tool`. Which tools a template offers is read
from the tags
its text demonstrates, so a new template file needs no code change.
"""

from __future__ import annotations

from functools import lru_cache

from stages.agent.tools import tool_names
from stages.core.templates import load_template


@lru_cache(maxsize=64)
def system_prompt(template: str = "tir_search_python") -> str:
    """The system prompt text of a template (file stem under configs/templates/)."""
    return load_template(template)


def build_messages(question: str, template: str = "tir_search_python") -> list[dict[str, str]]:
    """[system, user] messages for `tokenizer.apply_chat_template(..., add_generation_prompt=True)`."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"question must be a non-empty string, got {question!r}; check the dataset's question field")
    return [{"role": "system", "content": system_prompt(template)}, {"role": "user", "content": question}]


def template_tools(template: str = "tir_search_python") -> tuple[str, ...]:
    """Tools a template offers: those whose `<tool>` tag its text demonstrates ("search", "python")."""
    text = system_prompt(template)
    return tuple(tool for tool in tool_names() if f"<{tool}>" in text)

