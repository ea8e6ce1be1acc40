"""Nothing hangs silently (issue 55): a tool that never returns, a generate request that is never answered (verl's
server and the local engine's backend) and a verl run that stops making steps each end, within their configured
limits, in an infrastructure failure, a dropped tree or one clear error with the stacks in the stage folder.

Limits are small here; each test waits for its outcome with a generous ceiling (pytest's own timeout), never a
fixed sleep."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time

import psutil
import pytest

from stages.agent.protocol import ToolCall
from stages.agent.toolbox import ToolBox
from stages.agent.tools import Tool, ToolEnv, ToolOutput
from stages.core.config.agent import AgentSection
from stages.core.ratelimit import SharedRateLimiter
from stages.generation.generate_watch import GenerateTimeout, stuck_generate
from stages.generation.prompt_items import PromptItem
from stages.rl.rollout import TreeRollout
from stages.rl.verl.failures import INFRA, TreeFailureLog, record_failure, tree_fault
from stages.rl.verl.launch import latest_step, run_main_ppo
from stages.rl.verl.settings import SETTINGS_ENV
from stages.rl.verl.tree import ServerBackend
from stages.rl.verl.watchdog import STACK_DIR_ENV, RunStalled, StallWatch, stuck_part
from tests.unit.test_rl_rollout import cfg, search_then_answer
from tests.unit.test_rl_rollout_fakes import ScriptedBackend, ToyTokenizer, ToyToolBox

pytestmark = pytest.mark.timeout(120)
RELEASE = threading.Event()   # set at the end of a test: abandoned threads may finish


@pytest.fixture(autouse=True)
def _release_stuck_threads():
    RELEASE.clear()
    yield
    RELEASE.set()


class StuckSearch(Tool):
    """`hang` never returns (until the test ends); `slow` waits twice for a 1-per-second rate-limit slot;
    anything else answers at once."""

    name = "search"

    def __init__(self, cfg: AgentSection, env: ToolEnv, limiter: SharedRateLimiter | None = None) -> None:
        super().__init__(cfg, env)
        self.limiter = limiter

    def run(self, argument, state) -> ToolOutput:
        if argument == "hang":
            RELEASE.wait()
        if argument == "slow":
            self.limiter.acquire()
            self.limiter.acquire()
        return ToolOutput(f"R:{argument}", True)


def _box(tmp_path, **agent) -> ToolBox:
    cfg = AgentSection.model_validate({"cache": {"enabled": False}, **agent})
    return ToolBox(cfg, {"search": StuckSearch(cfg, ToolEnv(), SharedRateLimiter(tmp_path / "rate.slot", 1.0))})


def test_a_tool_that_never_returns_is_an_infra_failure_and_the_pool_recovers(tmp_path):
    box = _box(tmp_path, concurrency=2, tool_timeout_s=0.3)
    calls = [(ToolCall("search", q), box.new_state()) for q in ("hang", "hang", "after")]
    # both threads hang; "after" waits in the queue, moves to the fresh pool once they are given up on
    results = box.execute_many(calls)
    hung, done = results[:2], results[2]
    assert all(r.infra and not r.ok and r.meta["timeout"] for r in hung)
    assert "TimeoutError" in hung[0].text and "tool_timeout_s=0.3" in hung[0].meta["error"]
    assert done.ok and done.text == "R:after"
    metrics = box.metrics()
    assert metrics["infra_failures"] == 2 and metrics["timeouts"] == 2 and metrics["calls"] == 3
    box.close()   # returns although two abandoned threads still hang


def test_an_event_loop_caller_gets_the_same_limit(tmp_path):
    # evaluation's text loop awaits aexecute: one hung call and one quick one on a pool of one thread
    box = _box(tmp_path, concurrency=1, tool_timeout_s=0.3)

    async def both():
        return await asyncio.gather(box.aexecute(ToolCall("search", "hang"), box.new_state()),
                                    box.aexecute(ToolCall("search", "after"), box.new_state()))

    hung, done = asyncio.run(both())
    assert hung.infra and hung.meta["timeout"] and done.ok and done.text == "R:after"
    box.close()


def test_a_hung_tool_masks_its_trajectory_in_the_tree_loop(tmp_path):
    box = _box(tmp_path, concurrency=2, tool_timeout_s=0.3)
    tok = ToyTokenizer()

    def policy(ctx, key):   # the search query is "hang"; after the result, an answer
        return ("<search>hang</search>", 0.0) if "</result>" not in ctx else ("<answer>A</answer>\x00", 0.0)

    driver = TreeRollout(ScriptedBackend(tok, policy), box, tok, cfg(), "grpo", show_progress=False)
    batch = driver.rollout([PromptItem(0, tok.encode("user: q\nassistant:"), "q", "A", "qa")])
    (traj,) = batch.trajectories
    assert traj.infra_failures == 1 and traj.masked and traj.finish_reason == "eos"
    box.close()


def test_tool_queueing_counts_rate_limit_waits(tmp_path):
    box = _box(tmp_path, concurrency=1)
    # the second slot of a 1-per-second limiter is a second after the first: the call queued about that long
    (result,) = box.execute_many([(ToolCall("search", "slow"), box.new_state())])
    assert result.ok and result.queued_s > 0.5
    box.close()


def _never_answering_server():
    started, cancelled = threading.Event(), threading.Event()

    async def generate(request_id, *, prompt_ids, sampling_params):
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    return generate, started, cancelled


def test_an_unanswered_generate_request_drops_its_tree_as_an_infra_failure(tmp_path):
    generate, started, cancelled = _never_answering_server()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    tok = ToyTokenizer()
    try:
        backend = ServerBackend(generate, loop, "uid-7", tok, frozenset({0}), timeout_s=0.3)
        driver = TreeRollout(backend, ToyToolBox(), tok, cfg(n=2, initial_rollouts=2), "grpo", show_progress=False)
        with pytest.raises(GenerateTimeout) as raised:
            driver.rollout([PromptItem(0, tok.encode("user: q\nassistant:"), "q", "A", "qa")])
        assert started.is_set() and cancelled.wait(30)   # the pending requests were cancelled on the loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
    err = raised.value
    assert "answered 0 of 2 generate requests of tree uid-7" in str(err) and "generate_timeout_s=0.3" in str(err)
    # the agent-loop worker records it and drops the tree; the trainer mode counts it as an infra drop
    failures = tmp_path / "tree_failures.jsonl"
    assert tree_fault(err) == INFRA and record_failure(str(failures), "uid-7", False, err) == INFRA
    assert TreeFailureLog(str(failures)).take() == {"infra": 1}
    assert json.loads(failures.read_text())["error"].startswith("GenerateTimeout")


class SpinningBackend(ScriptedBackend):
    """A local backend whose generate never finishes: a Python loop waiting for tokens that never come."""

    def generate(self, requests, sampling, seed=None):
        while not RELEASE.is_set():
            time.sleep(0.01)
        return super().generate(requests, sampling, seed)


def test_a_stuck_local_generate_stops_the_step_with_its_stacks(tmp_path):
    tok = ToyTokenizer()
    driver = TreeRollout(SpinningBackend(tok, search_then_answer()), ToyToolBox(), tok,
                         cfg(generate_timeout_s=0.3), "grpo", show_progress=False)
    with pytest.raises(GenerateTimeout) as raised:
        driver.rollout([PromptItem(0, tok.encode("user: q\nassistant:"), "q", "A", "qa")])
    err = raised.value
    assert "generate_timeout_s=0.3" in str(err) and "round 1: 1 requests" in str(err)
    assert "in generate" in err.stacks and "SpinningBackend" not in str(err)
    out = stuck_generate(err, tmp_path, 3)   # what the local trainer raises
    path = tmp_path / "stacks" / "generate_timeout_step3.txt"
    assert path.read_text() == err.stacks and str(path) in str(out) and "resumes" in str(out)


def test_the_stall_watch_waits_for_progress():
    now = [0.0]
    watch = StallWatch(10.0, "/nonexistent", "settings", clock=lambda: now[0])
    for t, step in ((9.0, 1), (18.0, 2), (27.5, None)):
        now[0] = t
        watch.check(os.getpid())   # under 10 s since the last progress: nothing
        if step:
            watch.progress(step)
    assert watch.step == 2
    assert stuck_part("File .../stages/rl/verl/tree.py, line 130 in generate") == \
        "a generate request of a rollout tree (verl's LLM server)"
    assert stuck_part("nothing known") == "unknown: read the stacks"


HUNG_DRIVER = """
import threading
from stages.rl.verl.watchdog import register_stack_dump
register_stack_dump()
def update_actor():
    threading.Event().wait()
update_actor()
"""


@pytest.mark.parametrize("spy", [True, False], ids=["py-spy", "faulthandler"])
def test_a_stalled_run_stops_with_the_stuck_part_and_its_stacks(tmp_path, monkeypatch, spy):
    from stages.rl.verl import watchdog

    if not spy:   # verl's environment without py-spy: the SIGUSR2 faulthandler dump our plugin registers
        monkeypatch.setattr(watchdog, "py_spy", lambda: None)
    elif watchdog.py_spy() is None:
        pytest.skip("py-spy is not installed in this environment (the faulthandler case covers the fallback)")
    stage = tmp_path / "rl"
    (stage / "checkpoints").mkdir(parents=True)
    (stage / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("1")
    settings = str(stage / "plugin_settings.json")
    env = {**os.environ, STACK_DIR_ENV: str(stage / "stacks"), SETTINGS_ENV: settings,
           "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    watch = StallWatch(1.0, stage, settings)
    seen: list[int] = []
    with pytest.raises(RunStalled) as raised:
        run_main_ppo([], env, stage, poll_s=0.2, watch=watch, on_poll=lambda: seen.extend(
            p.pid for p in psutil.process_iter() if p.pid != os.getpid() and _has(p, settings)),
            command=[sys.executable, "-c", HUNG_DRIVER])
    message = str(raised.value)
    assert "no step progress for 1 s" in message and "stuck in: the actor update (FSDP)" in message
    assert "resumes from the newest checkpoint" in message
    dumps = list((stage / "stacks").glob("*/*.txt"))
    assert dumps and any("update_actor" in d.read_text() for d in dumps)
    # py-spy where the kernel lets it attach (ptrace policy), else the faulthandler dumps
    assert all(d.name.startswith(("py-spy-", "faulthandler-") if spy else "faulthandler-") for d in dumps)
    assert latest_step(stage / "checkpoints") == 1   # the run's checkpoints are untouched: a re-run resumes
    assert seen, "the driver never started"
    deadline = time.monotonic() + 60
    while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in set(seen)):
        assert time.monotonic() < deadline, "the stalled run's processes outlived the error"
        time.sleep(0.1)


def _has(proc: psutil.Process, settings: str) -> bool:
    try:
        return proc.environ().get(SETTINGS_ENV) == settings
    except (psutil.Error, OSError):
        return False
