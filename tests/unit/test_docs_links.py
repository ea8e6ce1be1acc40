"""Every relative link in the tracked Markdown files reaches a file, and its `#anchor` a heading of that file.

The README links into docs/ and docs/ link back into the README and each other; moving a section (the user's
guide vs docs/decisions.md and docs/benchmarks.md) must not leave a link pointing at nothing.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (not `-` / `_`), spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_slug_follows_github():
    # hand-derived from GitHub's rendering of these headings
    assert slug("Caching and reruns") == "caching-and-reruns"
    assert slug("Does RL learn? GRPO, ARPO and AEPO measured (`bench/bench_learning.py`)") == \
        "does-rl-learn-grpo-arpo-and-aepo-measured-benchbench_learningpy"
    assert slug("Checkpoint merge (verl FSDP → HF)") == "checkpoint-merge-verl-fsdp--hf"


def markdown_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", "*.md"], cwd=PROJECT_ROOT, capture_output=True, check=True).stdout
    return [PROJECT_ROOT / n for n in out.decode().split("\0") if n]


def outside_fences(text: str) -> list[str]:
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in outside_fences(path.read_text()) if line.startswith("#")}


def test_relative_links_reach_a_file_and_a_heading():
    broken = []
    for md in markdown_files():
        for line in outside_fences(md.read_text()):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue  # http(s), mailto
                file_part, _, anchor = target.partition("#")
                dest = (md.parent / file_part).resolve() if file_part else md
                where = f"{md.relative_to(PROJECT_ROOT)}: {target}"
                if not dest.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    broken.append(f"{where} (no heading with that anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken)
