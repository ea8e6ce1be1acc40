"""Stage keys follow the code: every module a stage's entry uses is in its key, comments and docstrings are not, and
a tool's cached results depend on that tool's code only (stages/core/codeversion.py, docs/caching.md)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import shutil
from modulefinder import ModuleFinder
from pathlib import Path

import pytest
from prefect import Task

import tasks
from stages.agent.tools import PythonTool, SearchTool
from stages.core.codeversion import STAGES, CodeIndex, code_text, code_version
from stages.core.stage_spec import SPECS
from tasks.stage_tasks import StageKey, entry_task

STAGES_DIR = STAGES.package_dir
ENTRIES = {"bootstrap": "stages.bootstrap.model", "data": "stages.data.prepare", "sft": "stages.sft.stage",
           "rl": "stages.rl.stage", "eval": "stages.eval.inference"}


def test_code_text_drops_comments_docstrings_and_blank_lines_only() -> None:
    source = ('"""Module doc."""\n'
              "import os  # why\n"
              "\n"
              "def f(x):\n"
              "    '''Doc\n"
              "    over lines.'''\n"
              "    s = '# not a comment'  # a comment\n"
              "    return x + 1\n")
    # by hand: the module docstring, the function's two-line docstring, both comments and the blank line go; the
    # '#' inside the string stays; trailing spaces left by a cut comment are stripped
    assert code_text(source) == "import os\ndef f(x):\n    s = '# not a comment'\n    return x + 1"


def test_code_text_cuts_docstrings_after_non_ascii_text() -> None:
    source = 'class A:\n    """Ünïcode doc."""\n    x = "é"  # ü\n'
    assert code_text(source) == 'class A:\n    x = "é"'


def _stage_tasks() -> dict[str, Task]:
    """Each stage's task: the one a tasks/ module writes by hand, else the one its table line builds."""
    found = {}
    for info in pkgutil.iter_modules(tasks.__path__):     # every task module: a new one is checked without a list
        module = importlib.import_module(f"tasks.{info.name}")
        for value in vars(module).values():
            if isinstance(value, Task) and isinstance(value.cache_policy, StageKey):
                found[value.cache_policy.stage] = value
    return {stage: found.get(stage) or entry_task(stage) for stage in SPECS} | found


def _called_stage_modules(task: Task) -> set[str]:
    """The stages modules whose functions the task body calls (directly, or by a 'module:function' target)."""
    fn = inspect.unwrap(task.fn)
    modules = set()
    for node in ast.walk(ast.parse(inspect.getsource(fn).lstrip())):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Name):
            target = fn.__globals__.get(node.func.id)
            if getattr(target, "__module__", "").startswith("stages."):
                modules.add(target.__module__)
        for arg in node.args:
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("stages."):
                modules.add(arg.value.partition(":")[0])
    return modules


def _modulefinder(entry: str) -> set[str]:
    """What the stdlib's bytecode scan finds the entry importing (lazy imports in functions included)."""
    finder = ModuleFinder(path=[str(STAGES_DIR.parent)])
    finder.import_hook(entry)
    return {name for name in finder.modules if name == "stages" or name.startswith("stages.")}


def test_every_stage_key_covers_every_module_its_entry_imports() -> None:
    tasks = _stage_tasks()
    assert set(tasks) == set(SPECS)  # every line of the stage table has its task, and no task is off the table
    for stage, task in tasks.items():
        key_module = task.cache_policy.function.__module__
        calls = [n for n in ast.walk(ast.parse(inspect.getsource(importlib.import_module(key_module))))
                 if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "code_version"]
        assert [ast.unparse(c) for c in calls] == ["code_version(__name__)"], stage  # the key hashes its own module
        covered = set(STAGES.closure(key_module))
        entries = _called_stage_modules(task) | {SPECS[stage].module}  # its entry point (call_entry) and any other
        # modulefinder scans every function of a package that runs only because a submodule is imported; the key
        # counts what that import runs, so the modules those functions import (and theirs) may be left out
        lazy = {m for p in covered for m in STAGES.imports_of(p) - STAGES.imports_of(p, top_level=True)} - covered
        excused = set(STAGES.closure(*lazy)) if lazy else set()
        for entry in entries:
            assert entry in covered, (stage, entry)
            assert _modulefinder(entry) - covered <= excused, (stage, entry)


def test_rl_reads_its_parquet_through_the_shared_schema_and_runs_verl_modules_by_name() -> None:
    covered = STAGES.closure("stages.rl.stage")
    assert "stages.core.rl_parquet" in covered
    assert "stages.rl.verl.plugin" in covered  # named as a string: verl imports it in its workers
    assert "stages.agent.sandbox.child.zygote_server" in covered and "stages.agent.search.web" in covered
    assert not [m for m in STAGES.closure("stages.bootstrap.model") if m.startswith(("stages.rl", "stages.agent"))]


def test_only_stage_keys_call_code_version_and_never_with_a_list() -> None:
    for path in STAGES_DIR.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "code_version":
                assert ast.unparse(node) == "code_version(__name__)", path


@pytest.fixture
def tree(tmp_path: Path) -> CodeIndex:
    """A copy of the stages package to edit, with its own saved index."""
    shutil.copytree(STAGES_DIR, tmp_path / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    return CodeIndex(tmp_path / "stages", tmp_path / "index.json")


def _keys(index: CodeIndex) -> dict[str, str]:
    return {stage: CodeIndex(index.package_dir, index.cache_file).code_version(entry)
            for stage, entry in ENTRIES.items()}


def _edit(index: CodeIndex, module: str, old: str, new: str) -> None:
    path = index.module_file(module)
    text = path.read_text(encoding="utf-8")
    assert old in text, (module, old)
    path.write_text(text.replace(old, new, 1), encoding="utf-8")


def test_comment_and_docstring_edits_change_no_key(tree: CodeIndex) -> None:
    before = _keys(tree)
    _edit(tree, "stages.agent.tools", '"""The tools an agent can call', '"""The tools an agent may call')
    _edit(tree, "stages.agent.loop", "from __future__ import annotations\n",
          "from __future__ import annotations  # a comment\n# a comment line\n")
    _edit(tree, "stages.core.rl_parquet", "\ndef ", "\n\n\ndef ")  # blank lines
    assert _keys(tree) == before


def test_a_code_change_in_the_shared_rl_parquet_schema_changes_the_rl_and_data_keys(tree: CodeIndex) -> None:
    before = _keys(tree)
    _edit(tree, "stages.core.rl_parquet", "\ndef ", "\nEXTRA = 1\n\n\ndef ")
    after = _keys(tree)
    assert after["rl"] != before["rl"] and after["data"] != before["data"]
    assert after["bootstrap"] == before["bootstrap"]  # bootstrap does not read the parquet schema


def test_saved_index_is_reused_until_a_file_changes(tree: CodeIndex, monkeypatch: pytest.MonkeyPatch) -> None:
    key = tree.code_version("stages.rl.stage")
    assert tree.cache_file.is_file()
    monkeypatch.setattr(ast, "parse", lambda *a, **k: pytest.fail("parsed a file the saved index holds"))
    assert CodeIndex(tree.package_dir, tree.cache_file).code_version("stages.rl.stage") == key
    monkeypatch.undo()
    _edit(tree, "stages.rl.losses", "\ndef ", "\nEXTRA = 1\n\n\ndef ")
    assert CodeIndex(tree.package_dir, tree.cache_file).code_version("stages.rl.stage") != key


def test_search_tool_key_follows_its_backend_only(tree: CodeIndex) -> None:
    def versions() -> dict[str, str]:
        fresh = CodeIndex(tree.package_dir)
        return {backend: fresh.class_code_version(SearchTool, (f"stages.agent.search.{backend}",))
                for backend in ("local", "web")}

    before = versions()
    assert before["local"] != before["web"]
    _edit(tree, "stages.agent.search.web", "\ndef ", "\nEXTRA = 1\n\n\ndef ")
    after = versions()
    assert after["local"] == before["local"] and after["web"] != before["web"]
    _edit(tree, "stages.agent.tools", "    def close(self) -> None:\n        self.sandbox.close()",
          "    def close(self) -> None:\n        self.sandbox.close()\n        return None")  # PythonTool
    assert versions() == after


def test_python_tool_key_covers_the_sandbox_modules(tree: CodeIndex) -> None:
    before = CodeIndex(tree.package_dir).class_code_version(PythonTool)
    _edit(tree, "stages.agent.sandbox.child.zygote_server", "\ndef ", "\nEXTRA = 1\n\n\ndef ")
    assert CodeIndex(tree.package_dir).class_code_version(PythonTool) != before


def test_code_version_is_stable_and_entry_specific() -> None:
    assert code_version("stages.rl.stage") == code_version("stages.rl.stage")
    assert code_version("stages.bootstrap.model") != code_version("stages.data.prepare")
    with pytest.raises(ModuleNotFoundError, match="stages.nope"):
        STAGES.closure("stages.nope")
