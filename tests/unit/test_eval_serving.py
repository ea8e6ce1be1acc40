"""Serving pieces without a model: the vLLM command line and environment, process-group teardown, the supervisor,
a stopped server's output (its log, not the console), backends' error messages, the retired cpu backend's config
error, and which servers a rerun needs."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stages.core.config.eval import JudgeSection
from stages.core.config.serve import ServeSection, VLLMSection
from stages.core.env import PROJECT_ROOT
from stages.core.procs import free_port, group_members, kill_group, launch, stop_group
from stages.core.refs import EndpointRef, ModelRef
from stages.eval.serving import expected_endpoint, expected_judge, start_judge, start_server, stop_server
from stages.eval.vllm_cmd import ServeError, resolve_executable, resolve_vllm, vllm_command, vllm_env

MODEL = ModelRef(path="/models/qwen7b", fingerprint="f" * 16, name="Qwen2.5-7B-Instruct")


def test_vllm_command_line_carries_every_setting() -> None:
    cfg = ServeSection(backend="vllm", host="0.0.0.0", vllm=VLLMSection(
        python="/envs/vllm/bin/python", tensor_parallel_size=2, gpu_memory_utilization=0.75, max_model_len=32768,
        dtype="bfloat16", extra_args=["--seed", "1"]))
    assert vllm_command(cfg, "/models/qwen7b", "Qwen2.5-7B-Instruct", 8002) == [
        "/envs/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/qwen7b",
        "--host", "0.0.0.0", "--port", "8002", "--served-model-name", "Qwen2.5-7B-Instruct",
        "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.75", "--max-model-len", "32768",
        "--dtype", "bfloat16", "--generation-config", "vllm", "--seed", "1"]
    # without a python, the `vllm` CLI; enforce_eager adds its flag before the extra arguments
    cli = cfg.model_copy(update={"vllm": cfg.vllm.model_copy(update={"python": None, "executable": "/x/vllm",
                                                                     "enforce_eager": True})})
    cmd = vllm_command(cli, "/models/qwen7b", "q", 8002)
    assert cmd[:3] == ["/x/vllm", "serve", "/models/qwen7b"] and cmd[-3:] == ["--enforce-eager", "--seed", "1"]


def test_tiny_profile_serves_with_vllm_cpu_settings() -> None:
    from stages.core.config.loader import load_config

    serve = load_config("tiny-cpu").serve
    assert serve.backend == "vllm" and serve.vllm.python == ".venv-vllm/bin/python"
    assert (serve.vllm.dtype, serve.vllm.max_model_len, serve.vllm.enforce_eager) == ("float32", 2048, True)
    assert vllm_env(serve, {"PATH": "/bin"}) == {"PATH": "/bin", "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert vllm_env(ServeSection(), {"PATH": "/bin"}) == {"PATH": "/bin"}   # no KV size: vLLM's default


def test_vllm_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        VLLMSection(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        VLLMSection(gpu_memory_utilization=1.5)


def test_retired_cpu_backend_is_a_config_error_naming_the_replacements() -> None:
    with pytest.raises(ValueError, match=r"retired.*serve\.backend=vllm.*serve\.backend=external"):
        ServeSection(backend="cpu")


def test_missing_vllm_environment_says_how_to_build_it(tmp_path: Path) -> None:
    with pytest.raises(ServeError, match=r"setup-vllm\.sh builds \.venv-vllm"):
        resolve_vllm(ServeSection(vllm=VLLMSection(python=str(tmp_path / "no-venv" / "bin" / "python"))))
    with pytest.raises(ServeError, match=r"not an executable.*setup-vllm\.sh"):
        resolve_executable(str(tmp_path / "no-vllm"))
    exe = tmp_path / "vllm"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert resolve_executable(str(exe)) == str(exe)
    # a relative python is the project's: .venv-vllm/bin/python -> <project>/.venv-vllm/bin/python
    relative = ServeSection(vllm=VLLMSection(python=os.path.relpath(exe, PROJECT_ROOT)))
    assert resolve_vllm(relative).vllm.python == str(PROJECT_ROOT / os.path.relpath(exe, PROJECT_ROOT))


def _forking_command() -> list[str]:
    # a parent that forks a grandchild; both sleep: killing must reach the whole group
    code = "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"
    return [sys.executable, "-c", code]


def test_kill_group_ends_the_server_and_its_children(tmp_path: Path) -> None:
    proc = launch(_forking_command(), tmp_path / "x.log")
    deadline = time.monotonic() + 20
    while len(group_members(proc.pid)) < 3 and time.monotonic() < deadline:  # supervisor, python, sleep
        time.sleep(0.05)
    assert len(group_members(proc.pid)) == 3
    kill_group(proc.pid, grace_s=5, proc=proc)
    assert group_members(proc.pid) == []
    assert proc.returncode is not None                      # reaped, not a zombie
    assert (tmp_path / "x.log").read_text().startswith("$ ")  # the command line heads the captured log


def test_stop_group_lets_the_command_stop_its_own_children(tmp_path: Path) -> None:
    """As a server stops its worker processes: the command, told alone, ends its child with SIGUSR1 and exits.
    The child must hear that, not a SIGTERM sent to the whole group before its parent could act."""
    heard = tmp_path / "heard"
    child = (f"import signal, time; p = {str(heard)!r}\n"
             "def on(sig, frame):\n"
             "    open(p, 'w').write(signal.Signals(sig).name); raise SystemExit(0)\n"
             "signal.signal(signal.SIGTERM, on); signal.signal(signal.SIGUSR1, on); open(p + '.ready', 'w')\n"
             "time.sleep(300)")
    leader = (f"import signal, subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', {child!r}])\n"
              "def on(sig, frame):\n"
              "    c.send_signal(signal.SIGUSR1); c.wait(); raise SystemExit(0)\n"
              f"signal.signal(signal.SIGTERM, on); open({str(heard)!r} + '.leader', 'w'); time.sleep(300)")
    proc = launch([sys.executable, "-c", leader], tmp_path / "x.log")
    deadline = time.monotonic() + 60
    while not (Path(f"{heard}.ready").exists() and Path(f"{heard}.leader").exists()) \
            and time.monotonic() < deadline:  # the child's handlers are set, and the leader's
        time.sleep(0.05)
    stop_group(proc.pid, grace_s=10, proc=proc)
    assert group_members(proc.pid) == []
    assert heard.read_text() == "SIGUSR1"                   # stopped by its parent, never by a group-wide SIGTERM
    assert proc.returncode == 0                             # the supervisor passed on the command's clean exit


def test_supervisor_kills_the_group_when_the_pipeline_dies_by_sigkill(tmp_path: Path) -> None:
    pgid_file = tmp_path / "pgid"
    script = textwrap.dedent(f"""
        import sys, time
        from stages.core.procs import launch
        proc = launch({_forking_command()!r}, {str(tmp_path / 'x.log')!r})
        open({str(pgid_file)!r}, 'w').write(str(proc.pid))
        time.sleep(300)
    """)
    pipeline = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + 30
        while (not pgid_file.is_file() or len(group_members(int(pgid_file.read_text() or 0))) < 3) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        pgid = int(pgid_file.read_text())
        assert len(group_members(pgid)) == 3
        os.kill(pipeline.pid, signal.SIGKILL)                 # no finally, no atexit runs
        pipeline.wait()
        deadline = time.monotonic() + 20
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert group_members(pgid) == []
    finally:
        if pipeline.poll() is None:
            pipeline.kill()
            pipeline.wait()


# A stand-in for vLLM's API server: prints as it serves, and on SIGTERM the kinds of teardown output vLLM prints
# (tests/unit/test_reporter.py has the real lines), then exits 0 ("clean"), 3 ("fail") or keeps running ("hang").
FAKE_SERVER = """
import signal, sys, time
mode = sys.argv[1]
def on_term(sig, frame):
    print("(APIServer pid=1) INFO [launcher.py:254] [shutdown] API server: shutdown triggered")
    print("Traceback (most recent call last):")
    print('  File "async_llm.py", line 849, in output_handler')
    print("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.")
    print("nanobind: leaked 4 instances!")
    print(' - leaked instance 0x7f of type "triton._C.libtriton.ir.attribute"', flush=True)
    print("multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: There appear to be 2 leaked "
          "shared_memory objects to clean up at shutdown", file=sys.stderr, flush=True)
    if mode == "fail":
        print("ERROR could not flush the request journal", flush=True)
        sys.exit(3)
    if mode == "clean":
        sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("INFO:     Application startup complete.", flush=True)
while True:
    time.sleep(0.05)
"""
NOISE = ("leaked", "resource_tracker", "Traceback", "EngineDeadError")


def _serve_fake(tmp_path: Path, mode: str) -> EndpointRef:
    from stages.eval import serving

    log_file, script = tmp_path / "vllm-fake.log", tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    proc = launch([sys.executable, str(script), mode], log_file)
    serving._LIVE[proc.pid] = proc             # as start_vllm registers the servers it starts
    deadline = time.monotonic() + 20
    while "\nINFO:     Application startup complete." not in log_file.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)                       # its SIGTERM handler is set
    endpoint = EndpointRef(url="http://127.0.0.1:9/v1", model="fake", meta={
        "backend": "vllm", "pid": proc.pid, "pgid": proc.pid, "log": str(log_file), "stop_grace_s": 5.0})
    serving.follow_output(endpoint, "vllm server")
    return endpoint


def test_a_clean_stop_shows_one_line_and_leaves_the_teardown_in_the_log(tmp_path: Path, caplog) -> None:
    endpoint = _serve_fake(tmp_path, "clean")
    with caplog.at_level(logging.INFO, logger="arpo"):
        stop_server(endpoint)
    console = [r.getMessage() for r in caplog.records]  # its start-up ("$ <command>", startup complete): log only
    assert len(console) == 1 and console[0].startswith(f"stopped vllm server {endpoint.url} (process group ")
    assert "; exit 0, " in console[0] and console[0].endswith(f"full output in {endpoint.meta['log']}")
    # 7 lines: [shutdown] (other), the 3-line traceback (errors), nanobind's 2, the tracker's warning
    assert ("not shown: 7 lines of its own teardown (1 other, 3 errors, 2 nanobind leak report, "
            "1 resource-tracker warnings)") in console[0]
    assert not [line for line in console if any(word in line for word in NOISE)]
    kept = Path(endpoint.meta["log"]).read_text()
    assert all(word in kept for word in NOISE)                                       # the log keeps them all
    assert group_members(endpoint.meta["pgid"]) == []


# A stand-in for vLLM's start: its 35 route lines (vLLM 0.32's start-up lists every route), then /health answers;
# `fail` exits with an engine error instead, as a start that runs out of memory does.
FAKE_VLLM = """
import http.server, sys
port, mode = int(sys.argv[1]), sys.argv[2]
for n in range(35):
    print(f"(APIServer pid=1) INFO 12:00:00 [launcher.py:46] Route: /v1/route{n}, Methods: POST", flush=True)
if mode == "fail":
    print("(EngineCore pid=2) ERROR 12:00:01 [core.py:700] RuntimeError: not enough KV cache memory", flush=True)
    sys.exit(1)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, fmt, *args):
        print(f'(APIServer pid=1) INFO:     127.0.0.1:5 - "GET {self.path} HTTP/1.1" 200 OK', flush=True)
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    from stages.eval import serving

    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    monkeypatch.setattr(serving, "resolve_vllm", lambda cfg: cfg)
    monkeypatch.setattr(serving, "vllm_env", lambda cfg: dict(os.environ))
    monkeypatch.setattr(serving, "vllm_command", lambda cfg, path, name, port: [sys.executable, str(script),
                                                                                str(port), mode])


def test_a_server_start_is_one_line_and_only_its_warnings_follow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  caplog) -> None:
    from stages.eval.serving import follow_output

    _fake_vllm(tmp_path, monkeypatch, "serve")
    with caplog.at_level(logging.INFO, logger="arpo"):
        endpoint = start_server(ServeSection(startup_timeout_s=60), MODEL, tmp_path)
        follow_output(endpoint, "vllm server")  # as serve_task does
        log_file = Path(endpoint.meta["log"])
        with open(log_file, "a", encoding="utf-8") as log:  # what it prints while it serves, as vLLM would
            log.write("(APIServer pid=1) INFO 12:00:10 [loggers.py:127] Engine 000: Avg generation throughput: 9.1\n"
                      "(APIServer pid=1) WARNING 12:00:11 [protocol.py:80] The following fields were present in the "
                      "request but ignored: {'seed_offset'}\n")
        deadline = time.monotonic() + 30
        while not any("WARNING" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.05)
        stop_server(endpoint)
    console = [r.getMessage() for r in caplog.records]
    port = endpoint.url.split(":")[-1].removesuffix("/v1")
    assert len(console) == 3, console  # the start, the one warning while serving, the stop
    assert console[0].startswith(f"vllm server for Qwen2.5-7B-Instruct up at http://127.0.0.1:{port}/v1 in ")
    assert console[0].endswith(f"(its output: {log_file})")
    assert console[1] == ("vllm server | (APIServer pid=1) WARNING 12:00:11 [protocol.py:80] The following fields were "
                          "present in the request but ignored: {'seed_offset'}")
    # the throughput line is counted, not shown; the 35 routes and the health checks of its start, not even counted
    assert console[2].startswith(f"stopped vllm server {endpoint.url} ") and \
        "not shown: 1 lines of its own below WARNING" in console[2]
    assert log_file.read_text().count("Route: /v1/route") == 35  # the log keeps every line


def test_a_failed_start_raises_with_the_log_tail_and_prints_nothing_else(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        caplog) -> None:
    _fake_vllm(tmp_path, monkeypatch, "fail")
    with caplog.at_level(logging.INFO, logger="arpo"), pytest.raises(ServeError) as failed:
        start_server(ServeSection(startup_timeout_s=60), MODEL, tmp_path)
    message = str(failed.value)
    assert message.startswith("the vllm server exited with code ") and "before healthy; log " in message
    assert message.rstrip().endswith("ERROR 12:00:01 [core.py:700] RuntimeError: not enough KV cache memory")
    assert "Route: /v1/route34" in message  # the tail: its last lines
    assert not [r for r in caplog.records if "Route:" in r.getMessage()]


@pytest.mark.parametrize("mode, grace, problem", [
    ("fail", 5.0, "it exited with status 3 (a clean stop exits 0 or by SIGTERM)"),
    ("hang", 0.5, "it did not stop within 0.5 s of SIGTERM, so its process group was killed (raise "
                  "serve.stop_grace_s=0.5 if it only needs longer)"),
])
def test_a_stop_that_goes_wrong_is_an_error_with_its_last_lines(tmp_path: Path, caplog, mode, grace, problem) -> None:
    endpoint = _serve_fake(tmp_path, mode)
    with caplog.at_level(logging.INFO, logger="arpo"):
        stop_server(endpoint, grace_s=grace)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and f"did not stop cleanly: {problem}; full output in " in errors[0]
    shown = errors[0].split("its last lines:\n", 1)[1].splitlines()
    # its own lines, known noise (nanobind, the tracker) left out; the hanging one heard two SIGTERMs (the
    # supervisor's, then the group's before the SIGKILL) and printed them twice
    own = ["(APIServer pid=1) INFO [launcher.py:254] [shutdown] API server: shutdown triggered",
           "Traceback (most recent call last):", '  File "async_llm.py", line 849, in output_handler',
           "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue."]
    assert shown == (own + ["ERROR could not flush the request journal"] if mode == "fail" else own + own)
    assert group_members(endpoint.meta["pgid"]) == []


def test_external_backend_errors_name_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs serve.url"):   # refused when the config loads
        ServeSection(backend="external")
    monkeypatch.delenv("ARPO_TEST_KEY", raising=False)
    cfg = ServeSection(backend="external", url="http://127.0.0.1:1/v1", api_key_env="ARPO_TEST_KEY")
    with pytest.raises(ServeError, match="export ARPO_TEST_KEY"):
        start_server(cfg, MODEL, tmp_path)
    port = free_port()  # nothing listens there
    with pytest.raises(ServeError, match="does not answer"):
        start_server(ServeSection(backend="external", url=f"http://127.0.0.1:{port}/v1"), MODEL, tmp_path)


def test_unknown_backend_lists_the_known_ones() -> None:
    from stages.eval.serving import BACKENDS

    assert BACKENDS.names() == ["external", "vllm"]


def test_judge_is_none_policy_or_served(tmp_path: Path) -> None:
    policy = EndpointRef(url="http://127.0.0.1:9/v1", model="smol", meta={"pgid": 999999999, "backend": "vllm"})
    assert start_judge(JudgeSection(enabled=False), policy, tmp_path) is None
    judge = start_judge(JudgeSection(model="policy"), policy, tmp_path)
    assert judge.url == policy.url and judge.model == "smol" and judge.meta["shared_with"] == "policy"
    stop_server(judge)  # shared: a no-op, never kills the policy server (pgid 999999999 would raise otherwise)
    with pytest.raises(ServeError, match="needs the policy endpoint"):
        start_judge(JudgeSection(model="policy"), None, tmp_path)
    with pytest.raises(ValueError, match="eval.judge.path"):   # refused when the config loads
        JudgeSection(model="path")


def test_planned_endpoints_carry_what_the_started_ones_would() -> None:
    # the identity stage keys hash: served name, weights fingerprint, sampling extras (vllm: yes; external: opt-in)
    planned = expected_endpoint(ServeSection(served_name="smol"), MODEL)
    assert (planned.model, planned.model_fingerprint, planned.meta["sampling_extras"]) == ("smol", "f" * 16, True)
    assert "pgid" not in planned.meta and planned.meta["planned"] is True     # nothing to stop
    stop_server(planned)
    external = expected_endpoint(ServeSection(backend="external", url="http://h/v1"), MODEL)
    assert external.model == "Qwen2.5-7B-Instruct" and external.meta["sampling_extras"] is False
    assert expected_judge(JudgeSection(enabled=False), planned) is None
    assert expected_judge(JudgeSection(model="policy"), planned).meta["shared_with"] == "policy"
    judge = expected_judge(JudgeSection(model="path", path="/models/judge72b"), planned)
    assert judge.model == "judge72b" and judge.model_fingerprint != planned.model_fingerprint


@pytest.mark.parametrize("judge, infer_done, score_done, refresh, expected", [
    ({"enabled": False}, True, False, [], (False, False)),            # all predictions on disk, rule scoring: none
    ({"enabled": False}, False, False, [], (True, False)),            # predictions missing: the policy server
    ({"enabled": False}, True, True, ["infer"], (True, False)),       # refreshed inference: the policy server
    ({"model": "policy"}, True, True, [], (False, False)),            # judged scores on disk too: none
    ({"model": "policy"}, True, False, [], (True, True)),             # the policy judges the missing scores
    ({"model": "policy"}, True, True, ["score"], (True, True)),
    ({"model": "path", "path": "/m/judge"}, True, False, [], (False, True)),   # only the separate judge
    ({"model": "path", "path": "/m/judge"}, False, False, [], (True, True)),
])
def test_serving_needs_starts_only_what_uncached_steps_use(monkeypatch: pytest.MonkeyPatch, judge, infer_done,
                                                           score_done, refresh, expected) -> None:
    from stages.core.config.loader import load_config
    from stages.core.refs import DatasetRef
    from stages.eval import reuse

    seen = {}

    def finished_inference(cfg, agent, benchmark, model, endpoint, data, root):
        seen["endpoint"] = endpoint
        return "preds-fp" if infer_done else None

    monkeypatch.setattr(reuse, "finished_inference", finished_inference)
    monkeypatch.setattr(reuse, "finished_scoring", lambda cfg, name, fp, j, root: score_done and fp == "preds-fp")
    cfg = load_config("tiny-cpu", [f"eval.judge={judge}"])
    needs = reuse.serving_needs(cfg, MODEL, DatasetRef(path="/d", fingerprint="d" * 16), refresh, score=True)
    assert (needs.policy, needs.judge) == expected
    assert seen.get("endpoint", needs.policy_endpoint) == expected_endpoint(cfg.serve, MODEL)
    assert bool(needs.missing) == any(expected)


def test_missing_vllm_env_fails_in_ci_and_skips_elsewhere(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import tests.conftest as conftest

    monkeypatch.setattr(conftest, "VLLM_PYTHON", tmp_path / "no-venv" / "bin" / "python")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="setup-vllm.sh builds .venv-vllm"):
        conftest.require_vllm_env()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="setup-vllm.sh"):
        conftest.require_vllm_env()
