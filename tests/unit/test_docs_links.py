"""The Markdown files (tracked, or new and not ignored) point at things that exist: every relative link reaches a
file, and its `#anchor` a heading of that file; every module or name written in code spans (`stages.core.selection`,
`stages.rl.stage:rl_key`) and every repository path (`stages/core/stage_spec.py`) exists; the README's Layout
section links to the one recipe for a new stage (CONTRIBUTING.md), which names the files it touches.

The README links into docs/ and docs/ link back into the README and each other; moving a section (the user's
guide vs docs/gpu-runbook.md, docs/benchmarks.md, ...) or renaming a module must not leave a pointer at nothing.
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
from pathlib import Path

from stages.core.env import PROJECT_ROOT

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
# a whole code span naming a module or a name in one: `stages.core.selection`, `stages.rl.stage:rl_key`, `x.y(...)`
DOTTED = re.compile(r"^((?:stages|flows|tasks|bench)(?:\.\w+)+)(?::(\w+))?(?:\(.*\))?$")
PATH = re.compile(r"^(?:stages|flows|tasks|bench|scripts|tests|configs|docs|requirements)/[\w./-]*$")
# named in the docs as removed (docs/decisions.md: the CPU server is retired; docs/testing.md's coverage map keeps the
# rows of the verl CPU smoke run, whose checks joined the verl rehearsal's run in issue 45)
REMOVED = {"stages/eval/cpu_server.py", "tests/integration/test_verl_cpu_smoke.py"}


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
    """Tracked Markdown files and new ones that git does not ignore (a page being added is checked too)."""
    out = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard", "*.md"], cwd=PROJECT_ROOT,
                         capture_output=True, check=True).stdout
    return [PROJECT_ROOT / n for n in dict.fromkeys(out.decode().split("\0")) if n and (PROJECT_ROOT / n).is_file()]


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


def code_spans(md: Path) -> list[str]:
    return [span.strip() for line in outside_fences(md.read_text()) for span in CODE_SPAN.findall(line)]


@functools.cache
def top_level_names(path: Path) -> frozenset[str]:
    """Names a module defines or imports at its top level (read, not imported: no module code runs)."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return frozenset(names)


def resolves(dotted: str) -> bool:
    """`a.b.c` is a module or package of the repo, or a name defined at the top level of one (`a.b` + `c`)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = PROJECT_ROOT.joinpath(*parts[:cut])
        for module in (base.with_suffix(".py"), base / "__init__.py"):
            if module.is_file():
                return cut == len(parts) or parts[cut] in top_level_names(module)
        if cut == len(parts) and base.is_dir():
            return True  # a package without __init__.py (bench)
    return False


def test_dotted_names_in_code_spans_name_real_modules() -> None:
    # hand-checked: a module, a function in one, a package, and two names that do not exist
    assert resolves("stages.core.selection") and resolves("stages.core.stage_spec.STAGE_SPECS")
    assert resolves("stages.rl") and resolves("bench.results.write_result")
    assert not resolves("stages.core.plan") and not resolves("tasks.eval_serve.served")
    broken = []
    for md in markdown_files():
        for span in code_spans(md):
            match = DOTTED.match(span)
            if match and not all(resolves(name) for name in
                                 [match.group(1)] + ([f"{match.group(1)}.{match.group(2)}"] if match.group(2) else [])):
                broken.append(f"{md.relative_to(PROJECT_ROOT)}: `{span}`")
    assert not broken, "code spans naming modules or names that do not exist:\n" + "\n".join(broken)


def test_repository_paths_in_code_spans_exist() -> None:
    broken = []
    for md in markdown_files():
        for span in code_spans(md):
            path = span.rstrip(".,:;")
            if not PATH.match(path) or path in REMOVED:
                continue
            # a template or profile may be named without its suffix (`configs/templates/tir_search_python`)
            if not (PROJECT_ROOT / path).exists() and not list((PROJECT_ROOT / path).parent.glob(
                    Path(path).name + ".*")):
                broken.append(f"{md.relative_to(PROJECT_ROOT)}: `{span}`")
    assert not broken, "code spans naming paths that do not exist:\n" + "\n".join(broken)


def readme_section(heading: str) -> str:
    text = (PROJECT_ROOT / "README.md").read_text()
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_the_readme_layout_says_where_a_new_stage_goes() -> None:
    layout = readme_section("Layout")
    for named in ("stages/core/stage_spec.py", "STAGE_SPECS", "StageSpec", "stages/core/selection.py",
                  "stages/core/algorithm_spec.py", "(CONTRIBUTING.md#adding-a-stage)"):
        assert named in layout, f"README, Layout: {named} is not named"
    # the recipe itself is stated once, in CONTRIBUTING.md, naming every file a new stage touches
    recipe = (PROJECT_ROOT / "CONTRIBUTING.md").read_text().split("\n## Adding a stage\n", 1)[1].split("\n## ", 1)[0]
    for named in ("stages/core/stage_spec.py", "STAGE_SPECS", "stages/<name>/", "flows/pipeline.py", "tasks/<name>.py",
                  "entry_task", "stage-<name>", "python -m flows.cli docs --write",
                  "stages/core/config/<name>.py", "stages/core/config/root.py", "docs/config.md", "@publishes"):
        assert named in recipe, f"CONTRIBUTING.md, Adding a stage: {named} is not named"
    from stages.core.stage_spec import STAGE_SPECS, StageSpec

    assert STAGE_SPECS and all(isinstance(spec, StageSpec) for spec in STAGE_SPECS)
    # every file and folder the layout's tree names is in the checkout
    tree = layout.split("```", 2)[1]
    tops = ("flows", "tasks", "stages", "bench", "scripts", "tests", "configs", "docs")
    entries = [p for top in tops for p in (PROJECT_ROOT / top).rglob("*") if "__pycache__" not in p.parts]
    files = {p.name for p in entries if p.is_file()}
    folders = {p.name for p in entries if p.is_dir()} | set(tops)
    missing = [name for name in re.findall(r"[\w.-]+\.(?:py|sh)\b", tree) if name not in files]
    missing += [f"{word}/" for word in re.findall(r"(?:^|\s)([a-z_]+)/(?=[\s,])", tree) if word not in folders]
    assert not missing, f"README, Layout names what the checkout lacks: {missing}"

