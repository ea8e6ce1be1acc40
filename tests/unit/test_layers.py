"""The layer rules (CONTRIBUTING.md, README "Layout") as a test: dependencies point one way.

flows -> tasks -> stages; inside stages, the stage packages -> the shared runtime (agent, generation) -> core.
Every import counts, lazy ones inside functions included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from stages.core.codeversion import STAGES

ROOT = STAGES.package_dir.parent
RUNTIME = {"agent", "generation"}


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _imported(path: Path) -> set[str]:
    """Top-level package names a file imports anywhere in it (absolute imports)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _package(module: str) -> str:
    """'stages.agent.tools' -> 'agent'; 'stages' -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.mark.parametrize("layer,forbidden", [
    ("stages", {"prefect", "prefect_ray", "tasks", "flows"}),
    ("tasks", {"flows"}),
])
def test_a_layer_never_imports_the_layers_above_it(layer: str, forbidden: set[str]) -> None:
    found = {_module(path): sorted(_imported(path) & forbidden) for path in _files(layer)}
    assert not {m: names for m, names in found.items() if names}


def _stage_imports() -> dict[str, set[str]]:
    return {_module(path): set(STAGES.imports_of(_module(path))) for path in _files("stages")}


def test_core_imports_no_other_stages_package() -> None:
    bad = {m: sorted(u for u in used if _package(u) not in ("core", "")) for m, used in _stage_imports().items()
           if _package(m) == "core"}
    assert not {m: used for m, used in bad.items() if used}


def test_the_runtime_imports_only_core_and_itself() -> None:
    allowed = RUNTIME | {"core", ""}
    bad = {m: sorted(u for u in used if _package(u) not in allowed) for m, used in _stage_imports().items()
           if _package(m) in RUNTIME}
    assert not {m: used for m, used in bad.items() if used}  # e.g. a data row type: declare a Protocol instead


def test_the_runtime_reads_no_rl_section() -> None:
    """Generation samples for SFT and held-out checks too: it reads GenerationSettings (RolloutSection.generation()
    makes them), never RL's config section."""
    bad = {m: sorted(u for u in used if u == "stages.core.config.rl") for m, used in _stage_imports().items()
           if _package(m) in RUNTIME}
    assert not {m: used for m, used in bad.items() if used}


def test_sft_code_never_reaches_rl() -> None:
    """Editing RL code keeps SFT's and DPO's cache: no module their keys cover is under stages.rl."""
    for entry in ("stages.sft.stage", "stages.sft.dpo"):
        assert not [m for m in STAGES.closure(entry) if _package(m) == "rl"], entry


def test_the_rules_see_a_lazy_import(tmp_path: Path) -> None:
    # by hand: an import inside a function body is found like a top-level one
    path = tmp_path / "lazy.py"
    path.write_text("def f():\n    import prefect\n    from flows.cli import main\n")
    assert _imported(path) == {"prefect", "flows"}


def _module_imports(path: Path, known: set[str]) -> set[str]:
    """The modules of `known` a file imports anywhere in it (absolute imports). `from pkg import name` is an
    import of the submodule pkg.name when there is one, else of pkg (its `__init__`): a package's `__init__` runs
    before any of its submodules, so that implied step is no edge of its own. Module names written as strings do
    not count: they are not imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            subs = {f"{node.module}.{alias.name}" for alias in node.names}
            names.update(subs & known if subs <= known else {node.module, *(subs & known)})
    return names & known


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` (module -> modules it imports) as [a, b, ..., a], or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        for used in sorted(graph.get(node, ())):
            if state.get(used) == 1:
                return [*path[path.index(used):], used]
            if used not in state and (found := visit(used, [*path, used])):
                return found
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return []


def test_no_import_cycle_in_stages() -> None:
    """No module of stages/ reaches itself through imports, lazy ones inside functions included: a piece two
    modules share moves down a layer (stages/agent/math_local.py under answer_match and math_worker,
    stages/cost/line.py under estimate and summarizer) instead of one importing the other inside a function."""
    files = {_module(path): path for path in _files("stages")}
    graph = {m: _module_imports(path, set(files)) - {m} for m, path in files.items()}
    assert not _cycle(graph)


def test_no_relative_import_in_stages() -> None:
    """The cycle check reads absolute imports only (as code_version does): a relative one would hide an edge."""
    relative = [_module(path) for path in _files("stages")
                if any(isinstance(node, ast.ImportFrom) and node.level
                       for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))))]
    assert not relative


def test_no_import_cycle_among_rl_modules() -> None:
    """The RL stage entry -> the engine registry -> the engines (trainer, verl), never back; lazy imports count."""
    files = {_module(path): path for path in _files("stages/rl")}
    graph = {m: _module_imports(path, set(files)) - {m} for m, path in files.items()}
    assert not _cycle(graph)


@pytest.mark.parametrize("layer", ["flows", "tasks"])
def test_no_import_cycle_in_the_wiring(layer: str) -> None:
    """The CLI, its subcommands, the launcher and the flows import one way (lazy imports count): `arpo rehearse`
    reaches the launcher in flows/launch.py, never the CLI module that registers it."""
    files = {_module(path): path for path in _files(layer)}
    graph = {m: _module_imports(path, set(files)) - {m} for m, path in files.items()}
    assert not _cycle(graph)


def test_the_cycle_check_finds_a_lazy_cycle(tmp_path: Path) -> None:
    # by hand: a -> b at top level, b -> a inside a function: the cycle a -> b -> a
    (tmp_path / "a.py").write_text("import pkg.b\n")
    (tmp_path / "b.py").write_text("def f():\n    from pkg import a\n")
    known = {"pkg.a", "pkg.b"}
    graph = {f"pkg.{n}": _module_imports(tmp_path / f"{n}.py", known) for n in ("a", "b")}
    assert _cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
    assert _cycle({"pkg.a": {"pkg.b"}, "pkg.b": set()}) == []


def test_from_a_package_import_a_submodule_is_an_edge_to_the_submodule(tmp_path: Path) -> None:
    # by hand: `from pkg import b` names the module pkg.b; `from pkg import f` (no pkg.f) names pkg's __init__;
    # `from pkg import b, f` names both
    known = {"pkg", "pkg.a", "pkg.b"}
    for text, edges in [("from pkg import b\n", {"pkg.b"}), ("def g():\n    from pkg import f\n", {"pkg"}),
                        ("from pkg import b, f\n", {"pkg", "pkg.b"})]:
        (tmp_path / "a.py").write_text(text)
        assert _module_imports(tmp_path / "a.py", known) == edges, text
