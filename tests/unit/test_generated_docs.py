"""Every generated block is listed once (flows/generated_docs.py), one command rewrites or checks them all
(`python -m flows.cli docs --write|--check`, run by CI beside ruff), and docs/decisions.md's list of them is
generated from that list."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from flows import generated_docs
from flows.generated_docs import GENERATED, run, stale
from stages.core.env import PROJECT_ROOT


def test_every_generated_block_is_up_to_date() -> None:
    # in a fresh process: the registries as the code defines them (a test may register a name of its own, e.g.
    # test_rl_trainer's reward function, into this session's registry, which docs/config.md would then list)
    check = subprocess.run([sys.executable, "-m", "flows.cli", "docs", "--check"], cwd=PROJECT_ROOT,
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and f"{len(GENERATED)} generated files up to date" in check.stdout, \
        f"a generated block is stale: run `python -m flows.cli docs --write`\n{check.stdout}{check.stderr}"


def test_every_file_with_a_generated_block_is_listed_and_the_list_is_generated() -> None:
    marker = re.compile(r"<!-- [\w-]+:start -->|# <[\w-]+:start>")
    files = [PROJECT_ROOT / "prefect.yaml", PROJECT_ROOT / "README.md", PROJECT_ROOT / "CONTRIBUTING.md",
             *sorted((PROJECT_ROOT / "docs").glob("*.md"))]
    with_blocks = {str(f.relative_to(PROJECT_ROOT)) for f in files if marker.search(f.read_text(encoding="utf-8"))}
    listed = {doc.path for doc in GENERATED}
    # docs/config.md is generated whole (no markers); every file holding markers has its generator listed
    assert with_blocks <= listed and listed - with_blocks == {"docs/config.md"}
    block = (PROJECT_ROOT / "docs" / "decisions.md").read_text(encoding="utf-8").split(generated_docs.START)[1]
    assert [line.split("`")[1] for line in block.split(generated_docs.END)[0].splitlines()[3:]] == \
        [doc.path for doc in GENERATED]


def test_a_stale_block_is_found_and_rewritten(tmp_path: Path) -> None:
    for doc in GENERATED:  # a copy of the generated files, to spoil one
        (tmp_path / doc.path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(PROJECT_ROOT / doc.path, tmp_path / doc.path)
    rollout = tmp_path / "docs" / "rollout.md"
    good = rollout.read_text(encoding="utf-8")
    rollout.write_text(good.replace("| `arpo` | `clip(u - w dH", "| `arpo` | `clip(u + w dH"), encoding="utf-8")
    assert rollout.read_text(encoding="utf-8") != good
    assert "docs/rollout.md" in [doc.path for doc, _ in stale(tmp_path)]
    run(write=True, root=tmp_path)
    assert rollout.read_text(encoding="utf-8") == good


def test_the_project_root_and_the_card_file_are_defined_once() -> None:
    # docs/decisions.md, "Facts stated once": each has one definition; code elsewhere imports it (tests may state
    # the file name as an expected value)
    definitions: dict[str, list[str]] = {"PROJECT_ROOT": [], "CARD_FILE": [], '"algorithm_card.md"': []}
    for folder in ("stages", "tasks", "flows", "bench", "scripts"):
        for path in (PROJECT_ROOT / folder).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            for name in ("PROJECT_ROOT", "CARD_FILE"):
                if re.search(rf"^{name}\s*[:=]", text, re.M):
                    definitions[name].append(str(path.relative_to(PROJECT_ROOT)))
            if '"algorithm_card.md"' in text:
                definitions['"algorithm_card.md"'].append(str(path.relative_to(PROJECT_ROOT)))
    assert definitions == {"PROJECT_ROOT": ["stages/core/env.py"], "CARD_FILE": ["stages/core/tracking/context.py"],
                           '"algorithm_card.md"': ["stages/core/tracking/context.py"]}
