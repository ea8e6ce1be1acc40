"""The code version of a stage: a hash over the `stages.*` modules its entry module actually uses.

`code_version("stages.rl.stage")` follows the entry module's imports (top-level ones and the lazy ones inside
functions: `import x`, `from x import y`, relative imports, and a string constant that is a bare module name such
as `"stages.sft.masking"`, which code runs with `python -m` or hands to verl by name), recursively over every
`stages.*` module reached, with the package `__init__`s that importing them runs. It hashes each module's code
with its comments, docstrings and blank lines removed, so only a change in what the code does changes a key
(docs/caching.md says what invalidates what).

Nothing is kept by hand: a module a stage starts to import enters its key, one it stops importing leaves it.
Modules are read from their files, never imported. What each file imports and the hash of its code are kept per
process and in `stages/__pycache__/codeversion.json` under the file's size and mtime (as Python keeps bytecode),
so a rerun reads no source it has read before.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import re
import textwrap
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from stages.core.atomic import write_text

_MODULE_NAME = r"(\.[A-Za-z_]\w*)+$"
_FORMAT = 1  # of the saved entries; raise it when what an entry holds changes


def code_text(source: str, tree: ast.AST | None = None) -> str:
    """The source without comments, docstrings and blank lines, each line right-stripped.

    Spans are cut from the text (not re-rendered from the AST), so the result is the same under any Python
    version that parses the file: a key computed by a stage running under another interpreter matches.
    """
    lines = source.splitlines()
    tree = tree if tree is not None else ast.parse(source)
    spans = [(s, _chars(lines, s, c), e, _chars(lines, e, ec)) for s, c, e, ec in _docstring_spans(tree)]
    spans += [(*tok.start, *tok.end) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
              if tok.type == tokenize.COMMENT]
    for start, col, end, end_col in sorted(spans, reverse=True):
        lines[start - 1:end] = [lines[start - 1][:col] + lines[end - 1][end_col:]]
    return "\n".join(line.rstrip() for line in lines if line.strip())


def _docstring_spans(tree: ast.AST) -> list[tuple[int, int, int, int]]:
    """(line, byte col, end line, end byte col) of every docstring: module, class, function."""
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                    isinstance(first.value.value, str):
                spans.append((first.lineno, first.col_offset, first.end_lineno, first.end_col_offset))
    return spans


def _chars(lines: list[str], line: int, byte_col: int) -> int:
    """AST columns count UTF-8 bytes; the text is cut in characters."""
    return len(lines[line - 1].encode("utf-8")[:byte_col].decode("utf-8", errors="ignore"))


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class CodeIndex:
    """The modules of one package tree (`stages`), what each imports, and the hash of each one's code."""

    package_dir: Path
    cache_file: Path | None = None
    _entries: dict[str, dict] = field(default_factory=dict)   # module -> {stat, imports, top, code}
    _checked: set[str] = field(default_factory=set)           # entries whose file this closure has checked
    _loaded: bool = False
    _dirty: bool = False

    @property
    def root(self) -> str:
        return self.package_dir.name

    def module_file(self, name: str) -> Path | None:
        """The file of a module or package (its `__init__.py`) of this tree, None when there is none."""
        parts = name.split(".")
        if parts[0] != self.root or not all(p.isidentifier() for p in parts):
            return None
        base = self.package_dir.joinpath(*parts[1:])
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
        return None

    def _entry(self, name: str) -> dict:
        """{imports, top, code} of one module, recomputed when its file's size or mtime changed."""
        if name in self._checked:
            return self._entries[name]
        path = self.module_file(name)
        if path is None:
            raise ModuleNotFoundError(f"code version: no module {name!r} under {self.package_dir}")
        self._load()
        st = path.stat()
        stat = [st.st_size, st.st_mtime_ns]
        entry = self._entries.get(name)
        if entry is None or entry["stat"] != stat:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source, filename=str(path))
            entry = {"stat": stat, "imports": sorted(self._used(name, tree) - {name}),
                     "top": sorted(self._used(name, tree, top_level=True) - {name}),
                     "code": _sha(code_text(source, tree))}
            self._entries[name], self._dirty = entry, True
        self._checked.add(name)
        return entry

    def imports_of(self, name: str, top_level: bool = False) -> frozenset[str]:
        """The modules of this tree one module uses directly (not recursively); with `top_level`, only those its
        import runs (none of the lazy imports inside its functions)."""
        return frozenset(self._entry(name)["top" if top_level else "imports"])

    def closure(self, *entries: str) -> tuple[str, ...]:
        """Every module the entries use, directly or through each other, the entries included; sorted.

        A module the code names (an import, a module string) counts with everything it imports, lazily inside its
        functions too. A package that only runs because a submodule of it is imported counts with what its import
        runs (its top-level imports): `stages.agent.search.web` brings the package `stages.agent.search`, not the
        other backends its factory functions import when called.
        """
        missing = [e for e in entries if self.module_file(e) is None]
        if missing:
            raise ModuleNotFoundError(f"code version: no module {missing[0]!r} under {self.package_dir}")
        self._checked.clear()  # each file is checked once per closure, and again by the next one
        named: set[str] = set()
        passed: set[str] = set()
        todo = [(name, True) for name in entries]
        while todo:
            name, by_name = todo.pop()
            if name in named or (name in passed and not by_name):
                continue
            (named if by_name else passed).add(name)
            todo += [(parent, False) for parent in self._parents(name)]
            todo += [(used, True) for used in self.imports_of(name, top_level=not by_name)]
        self._save()
        return tuple(sorted(named | passed))

    def code_version(self, *entries: str) -> str:
        """Hash over the code (no comments, docstrings) of every module the entry modules use."""
        return _sha("".join(f"{name}:{self._entry(name)['code']}\n" for name in self.closure(*entries)))

    def class_code_version(self, cls: type, uses: tuple[str, ...] | None = None) -> str:
        """Hash over a class's own code (its decorators and its bases of this tree included) and the modules it
        uses: those its body imports, or `uses` when given. What a class does without the rest of its module."""
        parts, imported = [], set()
        for klass in cls.__mro__:
            path = self.module_file(klass.__module__)
            if path is None:
                continue
            source = path.read_text(encoding="utf-8")
            node = _class_node(ast.parse(source), klass.__module__, klass.__qualname__)
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            text = textwrap.dedent("\n".join(source.splitlines()[first - 1:node.end_lineno]))
            parts.append(f"{klass.__module__}.{klass.__qualname__}:{_sha(code_text(text))}")
            imported |= self._used(klass.__module__, node)
        modules = set(imported if uses is None else uses)
        inside = sorted(m for m in modules if self.module_file(m) is not None)
        parts += sorted(modules - set(inside))  # a module outside the tree (a test's fake backend): its name only
        return _sha("\n".join(parts) + (self.code_version(*inside) if inside else ""))

    def _used(self, name: str, tree: ast.AST, top_level: bool = False) -> set[str]:
        """Modules of this tree that the code under `tree` imports or names as a bare module string (with
        `top_level`, outside function bodies only)."""
        named: set[str] = set()
        pattern = re.compile(re.escape(self.root) + _MODULE_NAME)
        for node in _walk(tree, into_functions=not top_level):
            if isinstance(node, ast.Import):
                named.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                module = self._absolute(name, node)
                named.add(module)
                named.update(f"{module}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and pattern.match(node.value):
                named.add(node.value)
        return {name for name in named if self.module_file(name) is not None}

    def _absolute(self, name: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        path = self.module_file(name)
        package = name if path is not None and path.name == "__init__.py" else name.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        return f"{package}.{node.module}" if node.module else package

    def _parents(self, name: str) -> list[str]:
        """The packages importing `name` runs first (`stages`, `stages.agent`, ... for `stages.agent.tools`)."""
        parts = name.split(".")
        return [".".join(parts[:i]) for i in range(1, len(parts))]

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        try:
            saved = json.loads(self.cache_file.read_text()) if self.cache_file else {}
        except (OSError, ValueError):
            return  # no cache yet, or an unreadable one: recomputed from the files
        if isinstance(saved, dict) and saved.get("format") == _FORMAT:
            self._entries.update(saved["modules"])

    def _save(self) -> None:
        if not (self._dirty and self.cache_file):
            return
        self._dirty = False
        try:
            write_text(self.cache_file, json.dumps({"format": _FORMAT, "modules": self._entries}, sort_keys=True))
        except OSError:
            pass  # a read-only tree: the per-process entries still serve this process


def _walk(tree: ast.AST, into_functions: bool = True) -> Iterator[ast.AST]:
    """ast.walk, optionally not into function bodies (what an import of the module runs)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        todo += [child for child in ast.iter_child_nodes(node)
                 if into_functions or not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _class_node(tree: ast.Module, module: str, qualname: str) -> ast.ClassDef:
    body: list[ast.stmt] = tree.body
    node = None
    for part in qualname.split("."):
        node = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == part), None)
        if node is None:
            raise LookupError(f"class {qualname} is not defined at the top of {module}")
        body = node.body
    assert node is not None
    return node


_PACKAGE_DIR = Path(__file__).resolve().parents[1]
STAGES = CodeIndex(_PACKAGE_DIR, _PACKAGE_DIR / "__pycache__" / "codeversion.json")


@cache
def code_version(*entries: str) -> str:
    """The code version of `stages.*` entry modules (a stage key passes its own `__name__`)."""
    return STAGES.code_version(*entries)


@cache
def class_code_version(cls: type, uses: tuple[str, ...] | None = None) -> str:
    """The code version of one class of `stages` and the modules it uses (a tool's cached results:
    stages/agent/tools.py)."""
    return STAGES.class_code_version(cls, uses)


def main(argv: list[str] | None = None) -> None:
    """`python -m stages.core.codeversion <entry module>...`: the modules in the entries' code version, and the key."""
    import sys

    entries = argv if argv is not None else sys.argv[1:]
    if not entries:
        raise SystemExit("usage: python -m stages.core.codeversion <entry module>... (e.g. the RL trainer's)")
    for name in STAGES.closure(*entries):
        print(name)
    print(f"{len(STAGES.closure(*entries))} modules, code version {STAGES.code_version(*entries)}")


if __name__ == "__main__":
    main()
