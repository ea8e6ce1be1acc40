"""The tools an agent can call: one registry, one class per tool, one config section each.

A tool is a `Tool` subclass registered with `@TOOLS.register("<name>")`; its settings are the `agent.<section>`
config section it names. Everything else follows from the registry: the protocol's tags `<name>…</name>` and
stop strings (stages.agent.protocol), which tools a prompt template offers (stages.agent.prompt_templates), the ToolBox's
admission (a per-tool cap where `agent.limits` names one: `ToolLimitsSection.per_tool`), cache entries and per-tool metrics.

    @TOOLS.register("calculator")
    class Calculator(Tool):
        section = "calculator"          # an `agent.calculator` Section (stages/core/config/agent.py)
        argument = "expression"          # names the argument in the "empty call" message
        def run(self, argument: str, state: CallState) -> ToolOutput:
            return ToolOutput(str(evaluate(argument)), True, {})

Built-in tools register here, in protocol order (search first: the reference checks its tags first). A tool
must never raise on model input: the ToolBox turns an exception into a tool error anyway, but a tool knows
better what to tell the model.

Whose failure a failed call is (`ToolOutput.fault`): `model` when the call itself caused it (an exception in the
model's code, a time or memory limit its code hit, a malformed or empty call, a query the backend has no answer
for), `infra` when the environment failed it (the search provider answered an error, a rate limit or a timeout
after the retries, the retrieval server is down, the sandbox could not start or died under the call). A tool
that fails for a reason that is not the model's must say `fault="infra"`: RL keeps trajectories touched by such
a result out of the loss and evaluation retries their samples (docs/agent.md, Whose failure is it).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from stages.core.codeversion import class_code_version
from stages.core.config.agent import AgentSection
from stages.core.fingerprint import hash_value
from stages.core.registry import Registry

MISS_MESSAGE = "No recorded search result for this query."
SEARCH_FAILED = "The search tool failed for this query. Try again later or continue without it."
MODEL, INFRA = "model", "infra"
Fault = Literal["model", "infra"]


@dataclass
class CallState:
    """Per-trajectory tool counters and seen queries; `scratch` holds a tool's own per-trajectory budget (e.g. the
    debugger's). `copy()` gives a branch its own copy of the prefix's."""

    counts: dict[str, int] = field(default_factory=dict)
    total: int = 0
    rejected: int = 0
    seen_queries: set[str] = field(default_factory=set)
    scratch: dict[str, int] = field(default_factory=dict)
    transcript: str = ""  # the trajectory's text so far, where a driver sets it (the browsing summariser reads it)

    def copy(self) -> CallState:
        return CallState(dict(self.counts), self.total, self.rejected, set(self.seen_queries), dict(self.scratch),
                         self.transcript)


@dataclass(frozen=True)
class ToolOutput:
    text: str
    ok: bool
    meta: dict[str, Any] = field(default_factory=dict)
    fault: Fault | None = None  # a failed call: whose failure (None on success; unset on a failure = "model")

    def __post_init__(self) -> None:
        if self.ok and self.fault is not None:
            raise ValueError(f"a successful tool output has no fault, got fault={self.fault!r}")
        if not self.ok and self.fault is None:
            object.__setattr__(self, "fault", MODEL)


@dataclass(frozen=True)
class ToolEnv:
    """What tools may need besides their config section."""

    corpus_path: str | None = None
    cache_root: str = ".cache"
    helper_url: str | None = None      # the debugger's LLM when agent.inference.llm_url is unset (the policy)
    helper_model: str | None = None
    # Tool-Star's inference-time tools are evaluation's (its run.py flags; its RL rollouts have none): only the eval
    # stage's toolbox turns them on, the training ones (RL rollouts, DPO self-samples, the teacher) never do
    inference_tools: bool = False


class Tool:
    name: ClassVar[str] = ""
    section: ClassVar[str | None] = None   # the AgentSection field holding this tool's settings
    argument: ClassVar[str] = "input"      # what the call's text is, for the "empty call" message

    def __init__(self, cfg: AgentSection, env: ToolEnv) -> None:
        self.cfg, self.env = cfg, env

    @property
    def settings(self) -> Any:
        return getattr(self.cfg, self.section) if self.section else None

    @classmethod
    def empty_message(cls) -> str:
        return (f"The {cls.name} {cls.argument} is empty. Write the {cls.argument} between <{cls.name}> and "
                f"</{cls.name}>.")

    @classmethod
    def limit_message(cls) -> str:
        return f"The maximum {cls.name} call limit is exceeded. You are not allowed to use {cls.name}."

    def prepare(self, argument: str) -> str:
        """The argument as run, cached and compared for repeats."""
        return argument

    def repeat_key(self, argument: str) -> str | None:
        """Calls with equal keys in one trajectory are repeats (`agent.limits.reject_repeated_queries`)."""
        return None

    def version(self) -> str:
        """Code and settings that change what a call returns: a cached result is reused only under the same. The
        code is the tool class's own and that of every module its body imports (stages.core.codeversion), not the
        rest of this module."""
        return class_code_version(type(self))

    def backend_id(self) -> str:
        """Which data answers (a corpus, an interpreter): part of the cache key beside the version."""
        return ""

    def run(self, argument: str, state: CallState) -> ToolOutput:
        raise NotImplementedError

    def cacheable(self, output: ToolOutput) -> bool:
        return output.ok

    def close(self) -> None:
        """Release processes, connections, indexes."""


TOOLS: Registry[type[Tool]] = Registry("tool")


def register_tool(name: str):
    def decorator(cls: type[Tool]) -> type[Tool]:
        cls.name = name
        return TOOLS.register(name)(cls)

    return decorator


@register_tool("search")
class SearchTool(Tool):
    section = "search"
    argument = "query"

    def __init__(self, cfg: AgentSection, env: ToolEnv, backend: Any = None, browser: Any = None) -> None:
        from stages.agent.search import build_search

        super().__init__(cfg, env)
        self.backend = backend or build_search(cfg.search, env.corpus_path, env.cache_root)
        self.browser = browser
        if browser is None and cfg.search.browse.enabled:
            from stages.agent.search.browse import Browser

            self.browser = Browser(cfg.search, env.cache_root)

    def prepare(self, argument: str) -> str:
        from stages.agent.search import normalize_query

        return normalize_query(argument)

    def repeat_key(self, argument: str) -> str | None:
        return argument.casefold()

    def version(self) -> str:
        """This class's code and the code of the backend that answers (its module and what that imports), not the
        other backends: a change in the local index code keeps paid web results."""
        s = self.cfg.search
        if self.browser is None:
            return hash_value(class_code_version(type(self), (type(self.backend).__module__,)), s.top_k,
                              s.max_chars_per_passage)
        browsing = (type(self.backend).__module__, "stages.agent.search.browse", "stages.agent.search.summarize")
        where_it_runs = {"url", "api_key_env", "timeout_s", "serve"}  # not what a summary says
        return hash_value(class_code_version(type(self), browsing), s.max_chars_per_passage,
                          s.browse.model_dump(), s.summarizer.model_dump(exclude=where_it_runs))

    def backend_id(self) -> str:
        found = f"{self.backend.name}:{self.backend.corpus_id}"
        return found if self.browser is None else f"{found}|{self.browser.identity}"

    def run(self, argument: str, state: CallState) -> ToolOutput:
        from stages.agent.search import SearchError, SearchMiss, format_passages

        s = self.cfg.search
        try:
            passages = self.backend.search(argument, s.browse.top_k if self.browser else s.top_k)
        except SearchMiss as miss:  # the recorded answers do not cover this query: retrying cannot change that
            return ToolOutput(MISS_MESSAGE, False, {"miss": True, "error": str(miss)}, MODEL)
        except SearchError as err:  # provider or server failed after the backend's retries
            return ToolOutput(SEARCH_FAILED, False, {"error": str(err)}, INFRA)
        if self.browser is None or not passages:
            return ToolOutput(format_passages(passages, s.max_chars_per_passage), True,
                              {"ids": [p.id for p in passages]})
        from stages.agent.search.summarize import steps_from_output

        out = self.browser.browse(argument, passages, steps_from_output(state.transcript))
        return ToolOutput(out.text, out.ok, out.meta, None if out.ok else (INFRA if out.infra else MODEL))

    def cacheable(self, output: ToolOutput) -> bool:
        """A browsed result with a page that failed for a network reason is not kept: the next call refetches."""
        return output.ok and not output.meta.get("pages_transient")

    def close(self) -> None:
        self.backend.close()
        if self.browser is not None:
            self.browser.close()


@register_tool("python")
class PythonTool(Tool):
    """Model-written code in the sandbox; with `agent.inference.debugger` a failing call is rewritten by an LLM
    once (per `max_debug`) and the fix runs instead (never cached)."""

    section = "python"
    argument = "code"

    def __init__(self, cfg: AgentSection, env: ToolEnv) -> None:
        from stages.agent.inference_tools import CodeDebugger, HelperLLM
        from stages.agent.sandbox.executor import PythonSandbox

        super().__init__(cfg, env)
        self.sandbox = PythonSandbox(cfg.python)
        self.debugger = None
        if cfg.inference.debugger and env.inference_tools:
            self.debugger = CodeDebugger(HelperLLM.from_config(cfg.inference, env.helper_url, env.helper_model))
        self._lock = threading.Lock()

    def version(self) -> str:
        """The sandbox's code and everything that changes what a call prints: the isolation mode actually in use
        (a host file readable under rlimit is not under bwrap), limits, seed, preloads, interpreter and its
        package versions (PythonSandbox.identity)."""
        return hash_value(class_code_version(type(self)), self.sandbox.identity())

    def backend_id(self) -> str:
        return f"sandbox:{self.sandbox.mode}:{self.sandbox.executable}"

    def run(self, argument: str, state: CallState) -> ToolOutput:
        result = self.sandbox.run(argument)
        meta = {**result.meta, "status": result.status}
        if not result.ok and not result.infra and self.debugger is not None and \
                result.status in ("error", "timeout", "cpu_limit"):
            with self._lock:  # one trajectory's calls may run at once (execute_many)
                allowed = state.scratch.get("python_debug", 0) < self.cfg.inference.max_debug
                state.scratch["python_debug"] = state.scratch.get("python_debug", 0) + allowed
            fixed = self.debugger.fix(argument, result.text) if allowed else None
            if fixed is not None:
                result = self.sandbox.run(fixed)
                meta = {**result.meta, "status": result.status, "debugged": True, "debug_code": fixed}
            if allowed:  # a debugger use, counted by the text loop (Tool-Star: no rollback after it)
                meta["debug_attempted"] = True
        fault = None if result.ok else (INFRA if result.infra else MODEL)
        return ToolOutput(result.text, result.ok, meta, fault)

    def cacheable(self, output: ToolOutput) -> bool:
        return output.ok and not output.meta.get("debugged")

    def close(self) -> None:
        self.sandbox.close()


def tool_names() -> tuple[str, ...]:
    """Every registered tool, in registration (protocol) order."""
    return tuple(TOOLS.ordered())
