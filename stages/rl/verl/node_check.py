"""What verl's agent-loop workers build, built once on each host before Ray and verl start (no verl import).

The workers build their tools on first use, inside verl's Ray actors (`stages.rl.verl.tree.shared_toolbox`): a
python sandbox that bubblewrap cannot start there, a search key that only the launcher's environment has, or a
tool cache folder that is not writable makes every tree fail, and verl reports it only after Ray, FSDP and vLLM
have started. `check_node(settings_path)` does on one host what a worker will do there:

- reads the plugin settings (`$ARPO_VERL_SETTINGS`: the file must be visible on every node);
- builds each tool the prompt template offers, as `ToolBox.from_config` does (sandbox mode, search backend and
  its key, the corpus of the local backend: its index is built once and cached for the workers);
- makes one real python call through the sandbox (`print(6 * 7)` must print 42);
- opens the tool cache (per host on a network filesystem, stages/agent/cache.py) and takes its write lock.

It never raises: the report lists each problem with its fix. `check_here` runs it in this process (verl's own
Ray cluster on this host; its workers inherit this process's environment); `check_cluster` runs it as a Ray task
pinned to every alive node of `rl.verl.ray_address` (num_cpus=0, so it runs on a full cluster), where a worker sees
the environment its node's `ray start` had, and also returns the nodes' CPUs. `require_workers` raises
`WorkerSetupError` naming every failing host.
"""

from __future__ import annotations

import socket
import traceback
from pathlib import Path
from typing import Any

from stages.core.errors import DeterministicError

PROBE_CODE = "print(6 * 7)"
NODE_TIMEOUT_S = 300.0


class WorkerSetupError(DeterministicError):
    """What the agent-loop workers need cannot be built on some host; the message names each fix."""


def _problem(what: str, err: BaseException) -> str:
    return f"{what}: {type(err).__name__}: {err}"


def _key_hint(agent: Any) -> str:
    web = agent.search.web
    return (f" On a joined Ray cluster (rl.verl.ray_address) the workers see the environment of their node's "
            f"`ray start`, not the launcher's (nor a key the pipeline read from a Prefect Secret block): export "
            f"{web.api_key_env} before `ray start` on every node.")


def check_tools(agent: Any, corpus_path: str | None, cache_root: str) -> tuple[dict[str, Any], list[str]]:
    """Build every tool the template offers (one real python call); (facts, problems)."""
    from stages.agent.prompt_templates import template_tools
    from stages.agent.tools import TOOLS, CallState, ToolEnv

    facts: dict[str, Any] = {}
    problems: list[str] = []
    env = ToolEnv(corpus_path, str(cache_root), None, None)
    for name in template_tools(agent.prompt_template):
        try:
            tool = TOOLS.get(name)(agent, env)
        except Exception as err:  # noqa: BLE001  (each failure is a line of the report)
            hint = _key_hint(agent) if name == "search" and agent.search.backend == "web" and \
                agent.search.web.api_key_env in str(err) else ""
            problems.append(_problem(f"the {name} tool cannot be built", err) + hint)
            continue
        try:
            if name == "python":
                out = tool.run(PROBE_CODE, CallState())
                facts["python"] = {"mode": tool.sandbox.mode, "ok": out.ok, "output": out.text[-300:]}
                if not (out.ok and out.text.strip() == "42"):
                    problems.append(f"the python sandbox ({tool.sandbox.mode}) could not run `{PROBE_CODE}`: "
                                    f"{out.text.strip()[-600:] or out.meta.get('status')}. Fix: "
                                    "agent.python.python_executable must name a working python with the preloads "
                                    "(agent.python.preload) on every node; docs/agent.md, python sandbox")
            elif name == "search":
                facts["search"] = {"backend": tool.backend.name, "corpus": tool.backend.corpus_id}
            else:
                facts[name] = {"built": True}
        finally:
            tool.close()
    return facts, problems


def check_cache(agent: Any, cache_root: str) -> tuple[dict[str, Any], list[str]]:
    """Open the tool cache the workers will open and take its write lock."""
    if not agent.cache.enabled:
        return {"enabled": False}, []
    from stages.agent.cache import ToolCache

    wanted = Path(agent.cache.path or Path(cache_root) / "tool_cache.sqlite")
    try:
        with ToolCache(wanted) as cache:
            cache.check_writable()
            return {"path": str(cache.path), "journal_mode": cache.journal_mode, "shared_fs": cache.shared_fs}, []
    except Exception as err:  # noqa: BLE001
        return {"path": str(wanted)}, [_problem(f"the tool cache {wanted} is not writable here", err) +
                                       ". Fix: agent.cache.path (or run.cache_root) must name a folder every node "
                                       "can write, or agent.cache.enabled=false"]


def check_node(settings_path: str | None = None) -> dict[str, Any]:
    """On this host: {"host", "ok", "problems": [...], "checks": {...}}; never raises."""
    from stages.rl.verl.settings import load_settings

    report: dict[str, Any] = {"host": socket.gethostname(), "checks": {}, "problems": []}
    try:
        settings = load_settings(settings_path)
    except Exception as err:  # noqa: BLE001
        report["problems"].append(_problem("the plugin settings cannot be read", err))
    else:
        try:
            tools, problems = check_tools(settings.agent, settings.corpus_path, settings.cache_root)
            cache, cache_problems = check_cache(settings.agent, settings.cache_root)
            report["checks"] |= {"tools": tools, "tool_cache": cache}
            report["problems"] += problems + cache_problems
        except Exception as err:  # noqa: BLE001  (a bug of the check itself: report it, with where)
            report["problems"].append(_problem("the worker check failed", err) + "\n" + traceback.format_exc(limit=4))
    report["ok"] = not report["problems"]
    return report


def check_here(settings_path: str) -> list[dict[str, Any]]:
    return [check_node(settings_path)]


def check_cluster(address: str, settings_path: str | None, timeout_s: float = NODE_TIMEOUT_S,
                  ray_module: Any = None) -> dict[str, Any]:
    """Join the Ray cluster at `address`: {"node_cpus": [CPUs of each alive node], "workers": [check_node's
    report per node]} (no worker check without `settings_path`). `ray_module` replaces `ray` in tests."""
    ray = ray_module
    if ray is None:
        import ray
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        nodes = [node for node in ray.nodes() if node["Alive"]]
        cpus = [float(node["Resources"].get("CPU", 0)) for node in nodes]
        if settings_path is None:
            return {"node_cpus": cpus, "workers": []}
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        task = ray.remote(num_cpus=0, max_retries=0)(check_node)
        refs = {node.get("NodeManagerHostname") or node["NodeManagerAddress"]: task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node["NodeID"], soft=False)).remote(
            settings_path) for node in nodes}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        return {"node_cpus": cpus, "workers": [_collect(ray, host, ref, ref in ready, timeout_s)
                                               for host, ref in refs.items()]}
    finally:
        ray.shutdown()


def _collect(ray: Any, host: str, ref: Any, done: bool, timeout_s: float) -> dict[str, Any]:
    if not done:
        return {"host": host, "ok": False, "checks": {}, "problems": [
            f"the worker check did not finish in {timeout_s:g} s on this node (a sandbox or search backend that "
            "hangs, or no Ray worker could start there)"]}
    try:
        return ray.get(ref)
    except Exception as err:  # noqa: BLE001  (the task could not even run there)
        return {"host": host, "ok": False, "checks": {}, "problems": [
            _problem("the worker check could not run on this node", err) + ". Fix: install this project into "
            "verl's environment on every node (scripts/setup-gpu.sh) with the same paths"]}


def require_workers(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The reports, or WorkerSetupError naming every host's problems and their fixes."""
    failed = [r for r in reports if not r.get("ok")]
    if failed:
        lines = [f"- {r['host']}: {p}" for r in failed for p in r["problems"]]
        raise WorkerSetupError("verl's agent-loop workers could not build their tools on "
                               f"{len(failed)} of {len(reports)} host(s); stopped before Ray and verl start:\n"
                               + "\n".join(lines))
    return reports
