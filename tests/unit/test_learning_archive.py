"""bench/learning_archive.py: a record's held-out answers, committed compressed beside it, reproduce its
per-question counts, name a changed byte (sha256) and a changed verdict, and grade again with the eval stage's
code. Runs of 2 `arith` questions x 2 samples, their responses written as the SFT policy answers."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

from bench import learning_archive as la
from bench import learning_questions as lq

CALL = "<think>I will use python.</think><python>print(347 * 812)</python> <result>\n281764\n</result>"
RIGHT = CALL + "<think>So 281764.</think><answer>The answer is \\boxed{281764}</answer>"
NO_EOS = RIGHT + "<|im_start|>user\nWhat is 1 * 2?<|im_end|><think>2</think><answer>\\boxed{2}</answer>"
WRONG = CALL + "<think>So 281765.</think><answer>The answer is \\boxed{281765}</answer>"


def run(tmp_path: Path, policy: str, responses: list[list[str]]) -> dict:
    """A worker's results file and its held-out predictions.jsonl (stages/heldout's rows)."""
    from stages.agent.protocol import check_format
    from stages.eval.content import content_correct

    folder = tmp_path / "heldout" / policy
    folder.mkdir(parents=True)
    rows = [{"question": f"q{i}", "answer": "281764", "ability": "math", "responses": rs,
             "correct": [check_format(r).ok and "281764}" in r for r in rs], "format_ok": [check_format(r).ok for r in rs],
             "tool_calls": [1 for _ in rs], "length": [100 for _ in rs], "reward": [0.0 for _ in rs]}
            for i, rs in enumerate(responses)]
    (folder / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    content = [[content_correct(r, "281764", "math") for r in rs] for rs in responses]
    return {"algorithm": policy, "seed": 0, "eval_seed": 0, "split": "eval_test", "samples": 2,
            "questions": ["q0", "q1"], "heldout_path": str(folder / "summary.json"),
            "correct_count_Q": [sum(r["correct"]) for r in rows], "formed_count_Q": [sum(r["format_ok"]) for r in rows],
            "calls_Q": [2, 2], "content_QN": content, "content_count_Q": [sum(c) for c in content],
            "config": {"rl": {"algorithm": "grpo", "optim": {"lr": 1e-5}, "trainer": {"total_steps": 8}}}}


def archived(tmp_path: Path) -> tuple[dict, dict[str, lq.Family]]:
    # SFT: q0 right + missing EOS (content 2, format-strict 1), q1 wrong twice; GRPO: q0 right twice, q1 right + wrong
    results = [run(tmp_path, "sft", [[RIGHT, NO_EOS], [WRONG, WRONG]]),
               run(tmp_path, "grpo", [[RIGHT, RIGHT], [RIGHT, WRONG]])]
    lq.write_per_question("learning-x", {"arith": lq.family_payload(results)}, root=tmp_path)
    entry = la.write_archive("learning-x", "arith", results, root=tmp_path / "predictions")
    return {"conditions": {"predictions": {"arith": entry}}}, lq.read_per_question("learning-x", tmp_path)


def test_the_archive_sums_to_the_per_question_counts_and_is_reproducible(tmp_path: Path) -> None:
    record, per_question = archived(tmp_path)
    assert per_question["arith"].runs["sft-s0"].content.tolist() == [2, 0]   # NO_EOS counts in content
    assert per_question["arith"].runs["sft-s0"].correct.tolist() == [1, 0]   # ... not in the format-strict count
    assert la.archive_problems("learning-x", record, per_question, tmp_path) == []
    entry = record["conditions"]["predictions"]["arith"]
    lines = la.read_archive(Path(entry["path"]))
    assert [(line["run"], line["q"]) for line in lines] == [("sft-s0", 0), ("sft-s0", 1), ("grpo-s0", 0),
                                                            ("grpo-s0", 1)]
    assert lines[0]["content"] == [True, True] and lines[0]["correct"] == [True, False]
    # written again from other folders, the bytes and the hash are the same (no timestamp, no path inside)
    again = la.write_archive("learning-x", "arith", [run(tmp_path / "again", "sft", [[RIGHT, NO_EOS], [WRONG, WRONG]]),
                                                     run(tmp_path / "again", "grpo", [[RIGHT, RIGHT], [RIGHT, WRONG]])],
                             root=tmp_path / "again-predictions")
    assert Path(again["path"]).read_bytes() == Path(entry["path"]).read_bytes() and again["sha256"] == entry["sha256"]


def test_an_altered_archive_or_verdict_is_named(tmp_path: Path) -> None:
    record, per_question = archived(tmp_path)
    entry = record["conditions"]["predictions"]["arith"]
    path = Path(entry["path"])
    lines = la.read_archive(path)
    lines[3]["content"] = [True, True]                    # grpo q1: one more right answer than the counts say
    data = gzip.compress("".join(json.dumps(x) + "\n" for x in lines).encode(), mtime=0)
    path.write_bytes(data)
    (problem,) = la.archive_problems("learning-x", record, per_question, tmp_path)
    assert "differs from the sha256 its record names" in problem
    entry["sha256"] = hashlib.sha256(data).hexdigest()  # a record that names the altered file: the counts catch it
    (problem,) = la.archive_problems("learning-x", record, per_question, tmp_path)
    assert problem == "learning-x: arith/grpo-s0 content counts differ from its archived predictions"
    # grading again names the altered line
    assert la.regrade(path) == ["arith.jsonl.gz: grpo-s0 question 1 grades differently now"]


def test_the_logs_hold_the_invocations_then_the_attempts(tmp_path: Path) -> None:
    path = la.write_logs("learning-x", [{"record": "learning-x", "wall_s": 60.0, "commit": "abc"}],
                         [{"job": "arith/grpo:0", "exit": 0, "cpu_s": 10.0}], root=tmp_path)
    lines = [json.loads(x) for x in Path(path).read_text().splitlines()]
    assert [x["kind"] for x in lines] == ["invocation", "attempt"] and lines[1]["job"] == "arith/grpo:0"


def _tiny_checkpoint(folder: Path):
    """A 1-layer Llama with random weights saved as a trainer checkpoint folder (model/), and the model in memory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from stages.core.refs import CheckpointRef

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True))
    model.save_pretrained(folder / "model")
    return model, CheckpointRef(path=str(folder), fingerprint="x", format="trainer")


def test_the_reload_check_passes_a_faithful_save_and_names_one_that_lost_the_training(tmp_path: Path) -> None:
    import torch

    from stages.core.atomic import write_json
    from stages.rl.probe import PROBE_FILE, probe_logprobs

    sequences = [[1, 5, 9, 13, 2], [3, 4, 60, 7]]
    model, policy = _tiny_checkpoint(tmp_path)
    # the trainer's probe from the weights it saved: the reloaded policy gives the same log-probs (fp32, one device)
    write_json(tmp_path / PROBE_FILE, {"sequences": sequences, "logprobs": probe_logprobs(model, sequences)})
    check = la.reload_check(policy)
    assert check["ok"] and check["max_abs_diff"] <= la.RELOAD_ATOL
    # the trainer's last step moved the weights but the saved files kept the old ones (a tied head written before
    # its update, say): the probe the trainer records differs from the reloaded policy's
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(0.5)
    write_json(tmp_path / PROBE_FILE, {"sequences": sequences, "logprobs": probe_logprobs(model, sequences)})
    check = la.reload_check(policy)
    assert not check["ok"] and check["max_abs_diff"] > 100 * la.RELOAD_ATOL
    table = la.reload_table([{"algorithm": "grpo", "seed": 0, "reload_check": check},
                             {"algorithm": "sft", "seed": 0}, {"algorithm": "arpo", "seed": 1}])
    assert [row[0] for row in table["rows"]] == ["grpo-s0", "arpo-s1"]
    assert table["rows"][0][2].startswith("over 0.0001") and table["rows"][1][1:] == ["not measured", ""]
