"""The tool environment of a trajectory: limits, repeat rules, the cache, the tools themselves, metrics.

    box = ToolBox.from_config(cfg.agent, corpus_path, cache_root)
    state = box.new_state()                      # one per trajectory; state.copy() for a branch
    call = parse_tool_call(model_text)           # stages.agent.protocol
    result = box.execute(call, state)            # ToolResult; append render_result(result.text)

Over a per-tool or total limit, on an empty argument, a repeated search query or an unavailable tool, the
call is not run and `result.text` says why (the model reads it inside <result>); `result.meta["rejected"]`
names the reason. Successful results of the tools in `agent.cache.tools` are cached in SQLite; a failure is
never cached, an infrastructure failure least of all (the next call must reach the provider again). The tools
themselves come from the tool registry (stages/agent/tools.py): the ToolBox knows no tool by name.

`result.fault` says whose failure a failed call is: `model` (its rejections, its code's errors, its empty or
malformed calls) or `infra` (the provider, server or sandbox failed; an unexpected exception inside a tool too:
a bug of ours is not the policy's fault). `metrics()` counts the infra ones as `infra_failures`.

Calls run on the process's tool pool (stages/agent/tool_pool.py: `agent.concurrency` threads; on verl one pool per
agent-loop worker serves all of its trees). A call still running `agent.tool_timeout_s` after it started is an
infrastructure failure (`meta["timeout"]`), so a tool that never returns cannot hold a rollout. `result.queued_s`
is the call's queueing: its wait for a pool thread plus its waits for rate-limit slots (stages/core/ratelimit.py).

Whatever text the model wrote, `execute` returns a ToolResult and never raises: lone surrogates (which JSON
decoders produce from `"\\ud800"`) become U+FFFD before any tool sees the argument, and an unexpected failure of
a tool comes back as a tool error (logged with its traceback, counted as `internal_errors`). Whatever a tool
returns, its text and meta leave `execute` as valid Unicode too (lone surrogates, the only code points UTF-8
cannot encode, become U+FFFD; a fetched PDF can produce them): no tool result can break the next model request,
whose client encodes it as UTF-8 JSON.
"""

from __future__ import annotations

import re
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Self

from stages.agent.cache import ToolCache
from stages.agent.prompt_templates import template_tools
from stages.agent.protocol import LIMIT_MESSAGES, REPEAT_MESSAGE, ToolCall
from stages.agent.tool_pool import ToolPool
from stages.agent.tools import INFRA, MISS_MESSAGE, MODEL, TOOLS, CallState, Fault, Tool, ToolEnv, tool_names
from stages.core.config.agent import AgentSection
from stages.core.log import get_logger
from stages.core.ratelimit import thread_wait_s
from stages.core.refs import DatasetRef

log = get_logger(__name__)
TOOL_FAILED = "The {tool} tool failed on this input ({error}). Continue without it or try different input."
_SURROGATE = re.compile("[\ud800-\udfff]")

__all__ = ["MISS_MESSAGE", "CallState", "ToolBox", "ToolResult", "corpus_path", "valid_text"]


def corpus_path(agent: AgentSection, data: DatasetRef | None) -> str | None:
    """The search corpus: the agent section's explicit path, else the data stage's corpus file."""
    return agent.search.corpus_path or (data.files.get("corpus") if data is not None else None)


def valid_text(text: str) -> str:
    """`text` as valid Unicode: each lone surrogate (not encodable as UTF-8) becomes U+FFFD."""
    return _SURROGATE.sub("\ufffd", text)


def valid_value(value: Any) -> Any:
    """`value` with every string in it (dict keys, list items, nested) made valid Unicode (`valid_text`)."""
    if isinstance(value, str):
        return valid_text(value)
    if isinstance(value, dict):
        return {valid_value(k): valid_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [valid_value(v) for v in value]
    return value


@dataclass(frozen=True)
class ToolResult:
    tool: str
    text: str
    ok: bool
    latency_s: float
    cached: bool
    meta: dict = field(default_factory=dict)
    fault: Fault | None = None  # None on success; model | infra on a failure (stages/agent/tools.py)
    queued_s: float = 0.0       # waited for a pool thread and for rate-limit slots

    @property
    def infra(self) -> bool:
        """The environment failed this call (provider, server, sandbox): not the policy's doing."""
        return self.fault == INFRA


class ToolBox:
    def __init__(self, cfg: AgentSection, tools: Mapping[str, Tool], cache: ToolCache | None = None) -> None:
        self.cfg, self.cache = cfg, cache
        self._tools = {name: tools[name] for name in tool_names() if name in tools}  # protocol order
        self.tools = tuple(self._tools)
        self._versions = {name: tool.version() for name, tool in self._tools.items()}
        self._lock = threading.Lock()
        self._stats: dict[str, float] = defaultdict(float)
        self._pool = ToolPool(cfg.concurrency, cfg.tool_timeout_s)

    @classmethod
    def from_config(cls, cfg: AgentSection, corpus_path: str | None, cache_root: str,
                    tools: tuple[str, ...] | None = None, helper_url: str | None = None,
                    helper_model: str | None = None, inference_tools: bool = False) -> ToolBox:
        """Build the tools the prompt template offers (or `tools`). `inference_tools`: the evaluation's toolbox,
        with Tool-Star's inference-time tools that `agent.inference` turns on (the debugger; training's toolboxes
        never have them); `helper_*` name the debugger's LLM when `agent.inference.llm_url/llm_model` are unset
        (e.g. the served policy)."""
        wanted = template_tools(cfg.prompt_template) if tools is None else tools
        for name in (*wanted, *cfg.cache.tools):
            TOOLS.get(name)  # an unknown tool fails here, naming the registered ones
        env = ToolEnv(corpus_path, str(cache_root), helper_url, helper_model, inference_tools)
        built = {name: TOOLS.get(name)(cfg, env) for name in tool_names() if name in wanted}
        cache = None
        if cfg.cache.enabled:
            cache = ToolCache(cfg.cache.path or Path(cache_root) / "tool_cache.sqlite")
        return cls(cfg, built, cache)

    def tool(self, name: str) -> Tool:
        return self._tools[name]

    def new_state(self) -> CallState:
        return CallState()

    # ---- admission: limits, empty arguments, repeats (under the lock: states may be shared) -----------------
    def _admit(self, call: ToolCall, state: CallState) -> tuple[str | None, str]:
        """(rejection reason or None, the argument to run)."""
        name, limits = call.tool, self.cfg.limits
        tool = self._tools.get(name)
        if tool is None:
            return "unavailable", call.argument
        per_tool = limits.per_tool(name)
        if per_tool is not None and state.counts.get(name, 0) >= per_tool:
            state.rejected += 1
            return f"limit:{name}", call.argument
        if state.total >= limits.max_calls:
            state.rejected += 1
            return "limit:total", call.argument
        state.counts[name] = state.counts.get(name, 0) + 1
        state.total += 1
        if not call.argument.strip():
            return "empty", call.argument
        argument = tool.prepare(call.argument)
        key = tool.repeat_key(argument)
        if key is None:
            return None, argument
        if limits.reject_repeated_queries and key in state.seen_queries:
            return "repeated", argument
        state.seen_queries.add(key)
        return None, argument

    @staticmethod
    def _rejection_text(reason: str, tool: str) -> str:
        if reason == "limit:total":
            return LIMIT_MESSAGES["total"]
        if reason.startswith("limit:"):
            return TOOLS.get(tool).limit_message()
        if reason == "empty":
            return TOOLS.get(tool).empty_message()
        if reason == "repeated":
            return REPEAT_MESSAGE
        return f"The {tool} tool is not available in this task."

    # ---- running -----------------------------------------------------------------------------------------
    def execute(self, call: ToolCall, state: CallState, queued_s: float = 0.0) -> ToolResult:
        """Run (or refuse) one call; `queued_s`: its wait for a pool thread so far (the rate-limit waits are
        added here)."""
        start, waited = time.monotonic(), thread_wait_s()
        call = ToolCall(call.tool, valid_text(call.argument))
        with self._lock:
            reason, argument = self._admit(call, state)
        if reason is not None:
            result = ToolResult(call.tool, self._rejection_text(reason, call.tool), False,
                                time.monotonic() - start, False, {"rejected": reason}, MODEL)
        else:
            try:
                result = self._cached_or_run(call.tool, argument, state, start)
            except Exception as err:  # a rollout must survive any input; the log keeps the bug
                log.exception("%s tool failed on a %d-character argument", call.tool, len(argument))
                result = ToolResult(call.tool, TOOL_FAILED.format(tool=call.tool, error=type(err).__name__), False,
                                    time.monotonic() - start, False, {"error": repr(err), "internal_error": True},
                                    INFRA)
        result = replace(result, text=valid_text(result.text), meta=valid_value(result.meta),  # the boundary
                         queued_s=queued_s + thread_wait_s() - waited)
        self._record(result)
        return result

    def _timed_out(self, item: tuple[ToolCall, CallState], running_s: float) -> ToolResult:
        """The result of a call that overran agent.tool_timeout_s: an infrastructure failure."""
        call = item[0]
        result = ToolResult(call.tool, TOOL_FAILED.format(tool=call.tool, error="TimeoutError"), False, running_s,
                            False, {"error": f"no result within agent.tool_timeout_s={self.cfg.tool_timeout_s:g} s",
                                    "timeout": True}, INFRA)
        self._record(result)
        return result

    def _cached_or_run(self, name: str, argument: str, state: CallState, start: float) -> ToolResult:
        tool = self._tools[name]
        use_cache = self.cache is not None and name in self.cfg.cache.tools
        key = (name, self._versions[name], argument, tool.backend_id())
        if use_cache:
            hit = self.cache.get(*key)
            if hit is not None:
                return ToolResult(name, hit["text"], True, time.monotonic() - start, True, hit.get("meta", {}))
        out = tool.run(argument, state)
        if use_cache and out.ok and tool.cacheable(out):  # never a failure, whatever a tool's cacheable says
            self.cache.put(*key, {"text": out.text, "meta": out.meta})
        return ToolResult(name, out.text, out.ok, time.monotonic() - start, False, out.meta, out.fault)

    def execute_many(self, items: list[tuple[ToolCall, CallState]]) -> list[ToolResult]:
        """Run calls concurrently (`agent.concurrency` at once, each within agent.tool_timeout_s); results in the
        order of `items`."""
        return self._pool.map(lambda item, queued: self.execute(*item, queued_s=queued), items, self._timed_out)

    async def aexecute(self, call: ToolCall, state: CallState) -> ToolResult:
        """`execute` on the pool for an event loop (evaluation), within agent.tool_timeout_s of its start."""
        return await self._pool.arun(lambda queued: self.execute(call, state, queued_s=queued),
                                     lambda running: self._timed_out((call, state), running))

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
            stats["infra_failures"] += result.infra
            if result.meta.get("timeout"):
                stats["timeouts"] += 1
            stats[f"{tool}_infra_failures"] += result.infra

    def metrics(self) -> dict[str, float]:
        """calls, errors, infra_failures, rejections, latency mean/max (overall and per tool), cache hits/misses."""
        with self._lock:
            out = dict(self._stats)
        for prefix in ["", *(f"{t}_" for t in tool_names())]:
            calls = out.get(f"{prefix}calls", 0.0)
            if calls:
                out[f"{prefix}latency_mean_s"] = out.pop(f"{prefix}latency_sum_s") / calls
        out.setdefault("calls", 0.0)
        out.setdefault("errors", 0.0)
        out.setdefault("infra_failures", 0.0)
        out.update(self.cache.stats() if self.cache else {"cache_hits": 0.0, "cache_misses": 0.0})
        return out

    def close(self) -> None:
        self._pool.close()
        for part in (*self._tools.values(), self.cache):
            if part is not None:
                part.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
