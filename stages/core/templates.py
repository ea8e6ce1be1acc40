"""Prompt templates are files under configs/templates/; a name is the file stem."""

from __future__ import annotations

from pathlib import Path

from stages.core.errors import MissingInputError

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "configs" / "templates"


def load_template(name: str, template_dir: Path = TEMPLATE_DIR) -> str:
    path = template_dir / f"{name}.txt"
    if not path.is_file():
        known = sorted(p.stem for p in template_dir.glob("*.txt"))
        raise MissingInputError(f"no prompt template {name!r} ({path}); known templates: {known}")
    return path.read_text(encoding="utf-8").strip()
