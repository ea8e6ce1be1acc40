"""Run code right after a module has been imported (no verl import; used by the plugin and the CPU test shim).

verl imports our plugin in every process it starts (`import verl` reads VERL_USE_EXTERNAL_MODULES), including the
many that never train or roll out (TransferQueue's controller and storage, reward workers, the load balancer,
Ray's agents). verl's trainer and agent-loop packages import vLLM (v1/trainer_base.py -> checkpoint_engine ->
vllm), ~200 MB and seconds of CPU per process; so the plugin registers what needs them only once verl itself has
imported those packages in that process.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, hook: Callable[[ModuleType], object]) -> None:
        self.name, self.hook = name, hook

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one shot: find the real spec, wrap its loader
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, hook = spec.loader.exec_module, self.hook

        def exec_then_hook(module: ModuleType) -> None:
            exec_module(module)
            hook(module)

        spec.loader.exec_module = exec_then_hook
        return spec


def after_import(name: str, hook: Callable[[ModuleType], object]) -> None:
    """Call `hook(module)` once `name` is imported (now, if it already is). Hook a package rather than one of its
    submodules when the hook imports from the package (its `__init__` is complete by then)."""
    if name in sys.modules:
        hook(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, hook))
