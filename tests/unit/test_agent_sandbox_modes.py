"""How the sandbox picks and reports its isolation: no silent fallback, any interpreter location (a venv under
/tmp), the non-root (user namespace) path, seeded calls, per-call uids shared by processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from stages.agent.sandbox.executor import PythonSandbox, probe_bwrap, resolve_mode
from stages.agent.sandbox.host import (
    UID_SPAN,
    SandboxUnavailable,
    UidAllocator,
    interpreter_paths,
)
from stages.core.config.agent import AgentSection, PythonToolSection
from stages.core.env import PROJECT_ROOT
from tests.unit.agent_support import bwrap_problem, require_bwrap

LIMITS = {"timeout_s": 4.0, "cpu_s": 2, "memory_mb": 256, "max_processes": 16, "max_file_mb": 2, "preload": []}


@pytest.fixture
def fresh_probe():
    probe_bwrap.cache_clear()
    yield
    probe_bwrap.cache_clear()


# ---- no silent fallback ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", ["auto", "bwrap"])
def test_missing_bwrap_stops_with_the_fix(setting, fresh_probe, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    with pytest.raises(SandboxUnavailable) as err:
        resolve_mode(PythonToolSection(sandbox=setting, **LIMITS))
    message = str(err.value)
    assert f"agent.python.sandbox={setting}" in message and "bubblewrap is not installed" in message
    for fix in ("apt-get install -y bubblewrap", "user namespaces", "agent.python.sandbox: rlimit"):
        assert fix in message
    assert resolve_mode(PythonToolSection(sandbox="rlimit", **LIMITS))[0] == "rlimit"  # the explicit opt-in


def test_broken_bwrap_stops_with_its_own_error(fresh_probe, tmp_path, monkeypatch):
    fake = tmp_path / "bwrap"  # what bwrap prints where user namespaces are forbidden
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with pytest.raises(SandboxUnavailable, match="No permissions to create new namespace") as err:
        PythonSandbox(PythonToolSection(**LIMITS))
    assert "agent.python.sandbox: rlimit" in str(err.value)


@pytest.mark.parametrize("ci, outcome", [("true", pytest.fail.Exception), ("", pytest.skip.Exception)])
def test_unusable_bwrap_fails_security_tests_in_ci(ci, outcome, fresh_probe, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # bubblewrap "not installed"
    monkeypatch.setenv("CI", ci)
    bwrap_problem.cache_clear()
    try:
        with pytest.raises(outcome, match="bubblewrap is not installed"):
            require_bwrap()
    finally:
        bwrap_problem.cache_clear()


def test_rlimit_is_reported(tmp_path, caplog):
    with PythonSandbox(PythonToolSection(sandbox="rlimit", **LIMITS)) as box:
        result = box.run("print(1)")
    assert result.meta["sandbox"] == "rlimit" and result.meta["sandbox_reason"].startswith("configured")
    assert "rlimit mode" in caplog.text


# ---- an interpreter anywhere: a venv under /tmp (a repo cloned there) -------------------------------------------
def test_interpreter_in_a_venv_under_tmp():
    require_bwrap()
    root = Path(tempfile.mkdtemp(prefix="arpo-venv-"))  # directly under /tmp, as a fresh clone would be
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
        python = root / "venv" / "bin" / "python"
        site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
        (site / "arpo_probe_module.py").write_text("ANSWER = 42\n")
        (root / "host-secret.txt").write_text("host file beside the venv")
        cfg = PythonToolSection(python_executable=str(python), **LIMITS)
        with PythonSandbox(cfg) as box:
            assert box.mode == "bwrap"
            first = box.run("import sys, arpo_probe_module\nprint(sys.prefix, arpo_probe_module.ANSWER)")
            # a second call gets a fresh /tmp and must still see the venv under it
            second = box.run(f"import os, arpo_probe_module\nprint(sorted(os.listdir({str(root)!r})), "
                             "arpo_probe_module.ANSWER)")
            write = box.run(f"open({str(site / 'pwned.py')!r}, 'w').write('x')")
        assert first.status == "ok" and first.text == f"{root / 'venv'} 42"
        assert second.status == "ok" and second.text == "['venv'] 42"  # the host file beside it stays hidden
        assert write.status == "error" and "Read-only file system" in write.text
        assert not (site / "pwned.py").exists()
    finally:
        shutil.rmtree(root)


# ---- the non-root path: the whole pipeline as an ordinary user ------------------------------------------------
NON_ROOT_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    from concurrent.futures import ThreadPoolExecutor
    from stages.agent.sandbox.host import interpreter_paths, tasks_of
    from stages.agent.sandbox.spec import sandbox_env
    from stages.agent.sandbox.zygote_client import WarmParent, zygote_argv

    settings = {"preload": [], "timeout_s": 4.0, "seed": None, "workdir_mb": 16,
                "limits": {"cpu_s": 2, "memory_mb": 256, "max_processes": 12, "max_file_mb": 2, "max_open_files": 64}}
    paths = interpreter_paths(sys.executable)
    parent = WarmParent(zygote_argv("bwrap", settings, paths, False), sandbox_env("/sandbox"), None, 60.0, 4.0)

    def run(code):
        outcome = parent.call(code.encode(), {"uid": None, "tasks": tasks_of(os.getuid())})
        out = os.pread(outcome.stdout_fd, 65536, 0).decode() if outcome.stdout_fd >= 0 else ""
        err = os.pread(outcome.stderr_fd, 65536, 0).decode() if outcome.stderr_fd >= 0 else ""
        outcome.close()
        return {"out": out.strip(), "err": err[-300:], "exit": outcome.exit, "facts": outcome.facts,
                "lost": outcome.lost}

    report = {"whoami": run("import os; print(os.getuid(), sorted(os.listdir('/proc'))[:2])")}
    report["state1"] = run("open('/tmp/left', 'w').write('x'); import json; json.LEAK = 1")
    report["state2"] = run("import os, json; print(os.listdir('/tmp'), hasattr(json, 'LEAK'))")
    report["caps"] = run("print([l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1])")
    bomb = "import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass"
    forker = ("import os, time\\ntime.sleep(1)\\nkids = []\\nfor _ in range(8):\\n    pid = os.fork()\\n"
              "    if pid == 0:\\n        time.sleep(0.5)\\n        os._exit(0)\\n    kids.append(pid)\\n"
              "for pid in kids:\\n    os.waitpid(pid, 0)\\nprint('forked 8')")
    with ThreadPoolExecutor(2) as pool:  # a fork bomb beside a call that needs 8 processes: counts are per call
        bombing = pool.submit(run, bomb)
        report["beside_bomb"] = run(forker)
        report["bomb"] = bombing.result()
    report["tasks"] = tasks_of(os.getuid())
    parent.close()
    print(json.dumps(report))
""")


def _non_root_problem() -> str | None:
    if os.geteuid() != 0:
        return "the suite runs as a non-root user already: every sandbox test above took the non-root path"
    for tool in ("setpriv", "bwrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not Path("/usr/bin/python3").exists():
        return "/usr/bin/python3 (an interpreter an ordinary user can run) is missing"
    probe = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bwrap",
                            "--unshare-user", "--ro-bind", "/", "/", "true"], capture_output=True, text=True,
                           check=False)
    if probe.returncode != 0:
        return f"unprivileged user namespaces are off here: {probe.stderr.strip()}"
    return None


def test_non_root_calls_get_their_own_user_namespace():
    """As an ordinary user (nobody, with the system python), drive the warm parent directly (stdlib only)."""
    if problem := _non_root_problem():
        pytest.skip(problem)
    package = Path(tempfile.mkdtemp(prefix="arpo-nonroot-"))
    try:
        (package / "stages" / "agent").mkdir(parents=True)
        for init in ("stages/__init__.py", "stages/agent/__init__.py"):
            (package / init).write_text("")
        shutil.copytree(PROJECT_ROOT / "stages" / "agent" / "sandbox", package / "stages" / "agent" / "sandbox",
                        ignore=shutil.ignore_patterns("__pycache__", "executor.py"))
        for path in [package, *package.rglob("*")]:
            path.chmod(0o755)
        done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
                               "-c", NON_ROOT_SCRIPT], cwd=package, env={"PATH": "/usr/bin:/bin",
                               "PYTHONPATH": str(package)}, capture_output=True, text=True, timeout=300,
                              check=False)
    finally:
        shutil.rmtree(package)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["whoami"]["out"].startswith("65534 ['1', "), report["whoami"]  # its own pid namespace
    assert report["state1"]["exit"]["exit"] == 0 and report["state2"]["out"] == "[] False"
    assert report["caps"]["out"] == "0000000000000000"  # no capability left for the code
    # the bomb filled its own budget of 12 and was ended with its pid namespace; the call beside it forked 8
    assert report["bomb"]["exit"]["timed_out"] or report["bomb"]["exit"]["exit"] < 0
    assert report["beside_bomb"]["out"] == "forked 8", report["beside_bomb"]["err"]
    assert report["tasks"] < 12  # nothing of the calls is left (the script and the sandbox's own processes)


# ---- seeded calls and the python cache ---------------------------------------------------------------------------
def test_seed_makes_calls_repeat_across_sandboxes():
    cfg = PythonToolSection(sandbox="rlimit", seed=7, **LIMITS)
    code = "import random\nprint(random.random(), list({'alpha', 'beta', 'gamma', 'delta', 'epsilon'}))"
    with PythonSandbox(cfg) as first, PythonSandbox(cfg) as second:
        outputs = {first.run(code).text, first.run(code).text, second.run(code).text}
    # one output: the generator is reseeded per call, and str hashing (set order) is fixed per sandbox
    assert len(outputs) == 1 and outputs.pop().startswith(str(__import__("random").Random(7).random()))


def test_python_cache_needs_a_seed():
    with pytest.raises(ValueError, match="agent.python.seed"):
        AgentSection.model_validate({"cache": {"tools": ["search", "python"]}})
    assert AgentSection.model_validate({"cache": {"tools": ["search", "python"]}, "python": {"seed": 0}})
    assert AgentSection().cache.tools == ["search"]  # default: python results are never replayed


def test_identity_tracks_what_changes_results():
    paths = interpreter_paths(sys.executable, ())
    assert paths.version == sys.version and paths.prefixes
    with PythonSandbox(PythonToolSection(sandbox="rlimit", **LIMITS)) as loose, \
            PythonSandbox(PythonToolSection(sandbox="rlimit", **{**LIMITS, "memory_mb": 512})) as roomy:
        assert loose.identity()["mode"] == "rlimit" and loose.identity() != roomy.identity()


# ---- per-call uids are unique across processes ------------------------------------------------------------------
ALLOCATE = textwrap.dedent("""
    import json, sys
    from stages.agent.sandbox.host import UidAllocator
    from pathlib import Path
    allocator = UidAllocator(5000, Path(sys.argv[1]))
    print(json.dumps([allocator.acquire() for _ in range(20)]))
    sys.stdout.flush()
    sys.stdin.read()  # hold them until the test is done
""")


def test_uids_are_unique_across_processes(tmp_path):
    lock = tmp_path / "uids.lock"
    ours = UidAllocator(5000, lock)
    held = {ours.acquire() for _ in range(20)}
    other = subprocess.Popen([sys.executable, "-c", ALLOCATE, str(lock)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=PROJECT_ROOT, env={**os.environ})
    try:
        theirs = set(json.loads(other.stdout.readline()))
    finally:
        other.communicate("", timeout=60)
    assert len(held) == 20 and len(theirs) == 20 and not held & theirs
    assert all(5000 <= uid < 5000 + UID_SPAN for uid in held | theirs)
    ours.release(min(held))
