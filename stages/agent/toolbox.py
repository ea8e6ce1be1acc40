"""The tool environment of a trajectory: limits, repeat rules, the cache, the tools themselves, metrics.

    box = ToolBox.from_config(cfg.agent, corpus_path, cache_root)
    state = box.new_state()                      # one per trajectory; state.copy() for a branch
    call = parse_tool_call(model_text)           # stages.agent.protocol
    result = box.execute(call, state)            # ToolResult; append render_result(result.text)

Over a per-tool or total limit, on an empty argument, a repeated search query or an unavailable tool, the
call is not run and `result.text` says why (the model reads it inside <result>); `result.meta["rejected"]`
names the reason. Successful results of the tools in `agent.cache.tools` are cached in SQLite.

Whatever text the model wrote, `execute` returns a ToolResult and never raises: lone surrogates (which JSON
decoders produce from `"\\ud800"`) become U+FFFD before any tool sees the argument, and an unexpected failure of
a tool comes back as a tool error (logged with its traceback, counted as `internal_errors`).
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from stages.agent.cache import ToolCache
from stages.agent.inference_tools import CodeDebugger, HelperLLM
from stages.agent.prompts import template_tools
from stages.agent.protocol import (
    EMPTY_MESSAGES,
    LIMIT_MESSAGES,
    REPEAT_MESSAGE,
    TOOLS,
    ToolCall,
)
from stages.agent.sandbox import PythonSandbox
from stages.agent.search import (
    SearchBackend,
    SearchError,
    SearchMiss,
    build_search,
    format_passages,
    normalize_query,
)
from stages.core.config.agent import AgentSection
from stages.core.fingerprint import code_version, hash_value
from stages.core.log import get_logger

log = get_logger(__name__)
MISS_MESSAGE = "No recorded search result for this query."
SEARCH_FAILED = "The search tool failed for this query. Try again later or continue without it."
TOOL_FAILED = "The {tool} tool failed on this input ({error}). Continue without it or try different input."
_SURROGATE = re.compile("[\ud800-\udfff]")
SANDBOX_MODULES = ("stages.agent.sandbox", "stages.agent.sandbox_isolation", "stages.agent.sandbox_os",
                   "stages.agent.sandbox_runner", "stages.agent.sandbox_spec", "stages.agent.sandbox_zygote")


def valid_text(text: str) -> str:
    """`text` as valid Unicode: each lone surrogate (not encodable as UTF-8) becomes U+FFFD."""
    return _SURROGATE.sub("\ufffd", text)


@dataclass
class CallState:
    """Per-trajectory tool counters and seen queries. `copy()` gives a branch its own copy of the prefix's."""

    counts: dict[str, int] = field(default_factory=dict)
    total: int = 0
    rejected: int = 0
    seen_queries: set[str] = field(default_factory=set)
    debug_used: int = 0

    def copy(self) -> CallState:
        return CallState(dict(self.counts), self.total, self.rejected, set(self.seen_queries), self.debug_used)


@dataclass(frozen=True)
class ToolResult:
    tool: str
    text: str
    ok: bool
    latency_s: float
    cached: bool
    meta: dict = field(default_factory=dict)


class ToolBox:
    def __init__(self, cfg: AgentSection, search: SearchBackend | None, sandbox: PythonSandbox | None,
                 cache: ToolCache | None = None, debugger: CodeDebugger | None = None) -> None:
        self.cfg, self.search, self.sandbox, self.cache, self.debugger = cfg, search, sandbox, cache, debugger
        self.tools = tuple(t for t, ok in (("search", search), ("python", sandbox)) if ok is not None)
        self._versions = {"search": self._search_version(), "python": self._python_version()}
        self._lock = threading.Lock()
        self._stats: dict[str, float] = defaultdict(float)
        self._pool = ThreadPoolExecutor(max_workers=cfg.concurrency, thread_name_prefix="toolbox")

    @classmethod
    def from_config(cls, cfg: AgentSection, corpus_path: str | None, cache_root: str,
                    tools: tuple[str, ...] | None = None, helper_url: str | None = None,
                    helper_model: str | None = None) -> ToolBox:
        """Build the tools the prompt template offers (or `tools`); `helper_*` name the debugger's LLM when
        `agent.inference.llm_url/llm_model` are unset (e.g. the served policy)."""
        wanted = template_tools(cfg.prompt_template) if tools is None else tools
        unknown = set(wanted) - set(TOOLS)
        if unknown:
            raise ValueError(f"unknown tools {sorted(unknown)}; known: {list(TOOLS)}")
        search = build_search(cfg.search, corpus_path, cache_root) if "search" in wanted else None
        sandbox = PythonSandbox(cfg.python) if "python" in wanted else None
        cache = None
        if cfg.cache.enabled:
            cache = ToolCache(cfg.cache.path or Path(cache_root) / "tool_cache.sqlite")
        debugger = None
        if cfg.inference.debugger and sandbox is not None:
            debugger = CodeDebugger(HelperLLM.from_config(cfg.inference, helper_url, helper_model))
        return cls(cfg, search, sandbox, cache, debugger)

    def new_state(self) -> CallState:
        return CallState()

    # ---- versions: a cached result is reused only by the same tool code and settings ------------------------
    def _search_version(self) -> str:
        if self.search is None:
            return ""
        modules = ["stages.agent.search.base"]
        if self.search.name in ("local", "server", "web", "replay"):
            modules.append(f"stages.agent.search.{self.search.name}")
        s = self.cfg.search
        return hash_value(code_version(*modules), s.top_k, s.max_chars_per_passage)

    def _python_version(self) -> str:
        """The sandbox's code and everything that changes what a call prints: the isolation mode actually in use
        (a host file readable under rlimit is not under bwrap), limits, seed, preloads, interpreter and its
        package versions (PythonSandbox.identity)."""
        if self.sandbox is None:
            return ""
        return hash_value(code_version(*SANDBOX_MODULES), self.sandbox.identity())

    def _backend_id(self, tool: str) -> str:
        if tool == "search" and self.search is not None:
            return f"{self.search.name}:{self.search.corpus_id}"
        return f"sandbox:{self.sandbox.mode}:{self.sandbox.executable}" if self.sandbox else ""

    # ---- admission: limits, empty arguments, repeats (under the lock: states may be shared) -----------------
    def _admit(self, call: ToolCall, state: CallState) -> tuple[str | None, str]:
        """(rejection reason or None, the argument to run)."""
        tool, limits = call.tool, self.cfg.limits
        if tool not in self.tools:
            return "unavailable", call.argument
        per_tool = {"python": limits.max_python, "search": limits.max_search}.get(tool)
        if per_tool is not None and state.counts.get(tool, 0) >= per_tool:
            state.rejected += 1
            return f"limit:{tool}", call.argument
        if state.total >= limits.max_calls:
            state.rejected += 1
            return "limit:total", call.argument
        state.counts[tool] = state.counts.get(tool, 0) + 1
        state.total += 1
        if not call.argument.strip():
            return "empty", call.argument
        if tool != "search":
            return None, call.argument
        query = normalize_query(call.argument)
        key = query.casefold()
        if limits.reject_repeated_queries and key in state.seen_queries:
            return "repeated", query
        state.seen_queries.add(key)
        return None, query

    @staticmethod
    def _rejection_text(reason: str, tool: str) -> str:
        if reason.startswith("limit:"):
            return LIMIT_MESSAGES[reason.split(":", 1)[1]]
        if reason == "empty":
            return EMPTY_MESSAGES.get(tool, "The tool call is empty.")
        if reason == "repeated":
            return REPEAT_MESSAGE
        return f"The {tool} tool is not available in this task."

    # ---- running -----------------------------------------------------------------------------------------
    def execute(self, call: ToolCall, state: CallState) -> ToolResult:
        start = time.monotonic()
        call = ToolCall(call.tool, valid_text(call.argument))
        with self._lock:
            reason, argument = self._admit(call, state)
        if reason is not None:
            result = ToolResult(call.tool, self._rejection_text(reason, call.tool), False,
                                time.monotonic() - start, False, {"rejected": reason})
        else:
            try:
                result = self._cached_or_run(call.tool, argument, state, start)
            except Exception as err:  # a rollout must survive any input; the log keeps the bug
                log.exception("%s tool failed on a %d-character argument", call.tool, len(argument))
                result = ToolResult(call.tool, TOOL_FAILED.format(tool=call.tool, error=type(err).__name__), False,
                                    time.monotonic() - start, False, {"error": repr(err), "internal_error": True})
        self._record(result)
        return result

    def _cached_or_run(self, tool: str, argument: str, state: CallState, start: float) -> ToolResult:
        use_cache = self.cache is not None and tool in self.cfg.cache.tools
        key = (tool, self._versions[tool], argument, self._backend_id(tool))
        if use_cache:
            hit = self.cache.get(*key)
            if hit is not None:
                return ToolResult(tool, hit["text"], True, time.monotonic() - start, True, hit.get("meta", {}))
        text, ok, meta = self._run_search(argument) if tool == "search" else self._run_python(argument, state)
        if use_cache and ok and not meta.get("debugged"):
            self.cache.put(*key, {"text": text, "meta": meta})
        return ToolResult(tool, text, ok, time.monotonic() - start, False, meta)

    def _run_search(self, query: str) -> tuple[str, bool, dict]:
        s = self.cfg.search
        try:
            passages = self.search.search(query, s.top_k)
        except SearchMiss as miss:
            return MISS_MESSAGE, False, {"miss": True, "error": str(miss)}
        except SearchError as err:
            return SEARCH_FAILED, False, {"error": str(err)}
        return format_passages(passages, s.max_chars_per_passage), True, {"ids": [p.id for p in passages]}

    def _run_python(self, code: str, state: CallState) -> tuple[str, bool, dict]:
        result = self.sandbox.run(code)
        meta = {**result.meta, "status": result.status}
        if not result.ok and self.debugger is not None and result.status in ("error", "timeout", "cpu_limit"):
            with self._lock:
                allowed = state.debug_used < self.cfg.inference.max_debug
                state.debug_used += allowed
            fixed = self.debugger.fix(code, result.text) if allowed else None
            if fixed is not None:
                result = self.sandbox.run(fixed)
                meta = {**result.meta, "status": result.status, "debugged": True, "debug_code": fixed}
        return result.text, result.ok, meta

    def execute_many(self, items: list[tuple[ToolCall, CallState]]) -> list[ToolResult]:
        """Run calls concurrently (`agent.concurrency` at once); results in the order of `items`."""
        return list(self._pool.map(lambda item: self.execute(*item), items))

    async def aexecute(self, call: ToolCall, state: CallState) -> ToolResult:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.execute, call, state)

    # ---- metrics and lifetime ------------------------------------------------------------------------------
    def _record(self, result: ToolResult) -> None:
        with self._lock:
            stats, tool = self._stats, result.tool
            reason = result.meta.get("rejected")
            if reason:
                stats["rejected"] += 1
                stats[f"rejected_{reason.replace(':', '_')}"] += 1
                return
            for prefix in ("", f"{tool}_"):
                stats[f"{prefix}calls"] += 1
                stats[f"{prefix}errors"] += not result.ok
                stats[f"{prefix}latency_sum_s"] += result.latency_s
                stats[f"{prefix}latency_max_s"] = max(stats[f"{prefix}latency_max_s"], result.latency_s)
            stats["search_misses"] += bool(result.meta.get("miss"))
            stats["internal_errors"] += bool(result.meta.get("internal_error"))

    def metrics(self) -> dict[str, float]:
        """calls, errors, rejections, latency mean/max (overall and per tool), cache hits/misses."""
        with self._lock:
            out = dict(self._stats)
        for prefix in ["", *(f"{t}_" for t in TOOLS)]:
            calls = out.get(f"{prefix}calls", 0.0)
            if calls:
                out[f"{prefix}latency_mean_s"] = out.pop(f"{prefix}latency_sum_s") / calls
        out.setdefault("calls", 0.0)
        out.setdefault("errors", 0.0)
        out.update(self.cache.stats() if self.cache else {"cache_hits": 0.0, "cache_misses": 0.0})
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for part in (self.sandbox, self.search, self.cache):
            if part is not None:
                part.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
