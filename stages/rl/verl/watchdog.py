"""The verl launcher's stall watchdog: a run that makes no step progress for `rl.verl.stall_timeout_s` is stopped
with one clear error, after the stacks of the trainer and its workers are written into the stage folder.

    watch = StallWatch(timeout_s, stage, settings_path)   # watch.progress() on every new step row
    watch.check(main_pid)                                  # in the launcher's poll: raises RunStalled when stuck

Stacks, into `<stage>/stacks/<time>/`: with py-spy installed in verl's environment (next to its interpreter or on
PATH), `py-spy dump` of every process of the run (the driver `main_ppo` and every process carrying the run's
settings path in its environment: Ray's workers, agent-loop workers, vLLM servers); else each Python process of the
run that imported our plugin has `faulthandler` registered on SIGUSR2 (`register_stack_dump`, writing into
`<stage>/stacks/faulthandler-<pid>.txt`), and the watchdog sends that signal. The error names the stuck part, read
off the stacks (`stuck_part`: a generate request, a tool call, a weight update, a collective), and says that
re-running the stage resumes from the newest checkpoint (the launcher kills the process group; checkpoints stay).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

STACK_DIR_ENV = "ARPO_STACK_DIR"      # where a run's processes write their faulthandler dumps
DUMP_SIGNAL = signal.SIGUSR2
FAULTHANDLER_PREFIX = "faulthandler-"
_registered: list = []                # the open dump files (kept alive for the process's lifetime)

# (text in a stack, the part it names): the first match over all stacks, in this order
STUCK_PARTS: tuple[tuple[str, str], ...] = (
    ("tool_pool.py", "a tool call (stages/agent/tool_pool.py)"),
    ("toolbox.py", "a tool call (stages/agent/toolbox.py)"),
    ("sandbox", "the python sandbox"),
    ("search/", "a search request"),
    ("verl/tree.py", "a generate request of a rollout tree (verl's LLM server)"),
    ("generate_sequences", "the rollout (verl's agent loop / LLM server)"),
    ("update_actor", "the actor update (FSDP)"),
    ("compute_log_prob", "the log-prob pass (FSDP)"),
    ("update_weights", "the weight sync to the rollout servers"),
    ("all_reduce", "a collective (NCCL / gloo all_reduce)"),
    ("barrier", "a collective barrier"),
)


class RunStalled(RuntimeError):
    """verl made no step progress within rl.verl.stall_timeout_s."""


def register_stack_dump(stack_dir: str | None = None) -> Path | None:
    """In a process of the run: dump every thread's stack into `<stack_dir>/faulthandler-<pid>.txt` on SIGUSR2
    (the file's existence tells the watchdog the signal is safe to send). Idempotent per process."""
    stack_dir = stack_dir or os.environ.get(STACK_DIR_ENV)
    if not stack_dir or _registered:
        return None
    path = Path(stack_dir) / f"{FAULTHANDLER_PREFIX}{os.getpid()}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a")   # noqa: SIM115 (faulthandler writes to it until the process ends)
    faulthandler.register(DUMP_SIGNAL, file=handle, all_threads=True, chain=False)
    _registered.append(handle)
    return path


def py_spy() -> str | None:
    """py-spy of verl's environment (next to its interpreter), else on PATH."""
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.is_file() else shutil.which("py-spy")


def run_processes(main_pid: int, settings_path: str) -> list[int]:
    """The driver and every process of the run (its descendants and the processes carrying its settings path)."""
    import psutil

    from stages.rl.verl.settings import SETTINGS_ENV

    pids = {main_pid}
    with contextlib.suppress(psutil.Error):
        pids |= {p.pid for p in psutil.Process(main_pid).children(recursive=True)}
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if proc.environ().get(SETTINGS_ENV) == settings_path:
                pids.add(proc.pid)
    pids.discard(os.getpid())
    return sorted(pids)


def dump_stacks(pids: Sequence[int], stack_dir: Path, wait_s: float = 10.0) -> list[Path]:
    """Every process's stacks into `stack_dir`: py-spy when installed, else SIGUSR2 to the processes that registered
    a faulthandler dump (their files, read after up to `wait_s`). Returns the files with stacks."""
    out_dir = stack_dir / time.strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    spy, written = py_spy(), []
    if spy:
        for pid in pids:
            proc = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60,
                                  check=False)
            if proc.stdout.strip():
                path = out_dir / f"py-spy-{pid}.txt"
                path.write_text(proc.stdout)
                written.append(path)
        if written:
            return written
    files = {pid: stack_dir / f"{FAULTHANDLER_PREFIX}{pid}.txt" for pid in pids}
    sizes = {pid: f.stat().st_size for pid, f in files.items() if f.is_file()}
    for pid in sizes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, DUMP_SIGNAL)
    deadline = time.monotonic() + wait_s
    while sizes and time.monotonic() < deadline:
        if all(files[pid].stat().st_size > size for pid, size in sizes.items()):
            break
        time.sleep(0.1)
    for pid, size in sizes.items():
        text = files[pid].read_text(errors="replace")[size:]
        if text.strip():
            path = out_dir / f"faulthandler-{pid}.txt"
            path.write_text(text)
            written.append(path)
    return written


def stuck_part(stacks: str) -> str:
    """The part of the run the stacks show waiting (STUCK_PARTS), or a pointer to the stacks."""
    return next((part for needle, part in STUCK_PARTS if needle in stacks), "unknown: read the stacks")


class StallWatch:
    def __init__(self, timeout_s: float | None, stage: Path, settings_path: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s, self.stage, self.settings_path, self.clock = timeout_s, Path(stage), settings_path, clock
        self.last = clock()
        self.step: int | None = None

    def progress(self, step: int | None = None) -> None:
        self.last, self.step = self.clock(), step if step is not None else self.step

    def check(self, main_pid: int) -> None:
        """Raise RunStalled (after writing the stacks) when no progress came within timeout_s."""
        if self.timeout_s is None or self.clock() - self.last < self.timeout_s:
            return
        files = dump_stacks(run_processes(main_pid, self.settings_path), self.stage / "stacks")
        part = stuck_part("\n".join(f.read_text(errors="replace") for f in files))
        where = (f"the stacks of {len(files)} processes are in {files[0].parent}" if files else
                 "no stacks could be taken (install py-spy in verl's environment)")
        after = f"step {self.step}" if self.step is not None else "the start"
        raise RunStalled(f"verl made no step progress for {self.timeout_s:g} s (rl.verl.stall_timeout_s) after "
                         f"{after}; stuck in: {part}. {where}. The run was stopped; re-running the stage resumes "
                         "from the newest checkpoint")
