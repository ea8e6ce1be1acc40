"""Teacher trajectories: the exact TIR text, tool output inserted with render_result, unsupported tasks dropped.

The tools here are small but real: python runs the code in a child interpreter; search returns the corpus
documents whose text contains every query word, those the query names first (the real BM25 toolbox runs in
tests/integration/test_sft_train.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stages.agent.prompt_templates import system_prompt
from stages.agent.protocol import ToolCall, check_format, count_tool_calls, extract_answer
from stages.core.config.data import SyntheticSection
from stages.data.synthetic import generate
from stages.sft.teacher import (
    UnsupportedTrajectory,
    build_trajectories,
    chain_trajectory,
    corpus_docs,
    math_trajectory,
    qa_trajectory,
    split_doc,
    train_tasks,
)

GEN = generate(SyntheticSection(seed=5, n_math=10, n_qa=10, n_entities=12, n_chain=8))
DOCS = {d["id"]: split_doc(d["contents"]) for d in GEN.corpus}


def run_tool(call: ToolCall) -> str:
    if call.tool == "python":
        return subprocess.run([sys.executable, "-c", call.argument], capture_output=True, text=True,
                              timeout=60).stdout.strip()
    words = call.argument.lower().split()
    hits = [d["contents"] for d in GEN.corpus if all(w in d["contents"].lower() for w in words)]
    hits.sort(key=lambda text: split_doc(text)[0] not in call.argument)  # documents named by the query first
    return "\n".join(f"Page {i + 1}: {text}" for i, text in enumerate(hits[:3]))


def _task(kind: str) -> dict:
    return next(t.to_json() for t in GEN.tasks if t.kind == kind and t.split == "train")


def test_math_trajectory_is_the_exact_protocol_text() -> None:
    import random

    task = _task("math")
    text = math_trajectory(task, run_tool, random.Random(0))
    # the python block, then the environment's insertion " <result>\n{output}\n</result>" (render_result)
    assert f"<python>\n{task['solution_code']}\n</python> <result>\n{task['answer']}\n</result>\n<think>" in text
    assert text.startswith("<think> ") and text.endswith(
        f"<answer> The final answer is \\[ \\boxed{{{task['answer']}}} \\] </answer>")
    assert check_format(text).ok and extract_answer(text) == task["answer"]
    assert count_tool_calls(text) == {"search": 0, "python": 1}


def test_qa_trajectory_searches_every_hop() -> None:
    import random

    task = _task("qa")
    text = qa_trajectory(task, run_tool, random.Random(0), DOCS)
    for hop in task["hops"]:
        assert f"<search> {hop['query']} </search> <result>\n" in text
        assert DOCS[hop["doc_id"]][0] in text
    assert check_format(text).ok and extract_answer(text) == task["answer"]
    assert count_tool_calls(text) == {"search": len(task["hops"]), "python": 0}


def test_chain_trajectory_computes_on_what_the_search_returned() -> None:
    import random

    task = _task("chain")
    (hop,) = task["hops"]
    text = chain_trajectory(task, run_tool, random.Random(0), DOCS)
    search, python = text.index(f"<search> {hop['query']} </search> <result>\n"), text.index("<python>")
    assert search < text.index(hop["fact"]) < python       # the year is read from the result, then computed on
    assert f"<python>\n{task['solution_code']}\n</python> <result>\n{task['answer']}\n</result>" in text
    assert check_format(text).ok and extract_answer(text) == task["answer"]
    assert count_tool_calls(text) == {"search": 1, "python": 1}
    with pytest.raises(UnsupportedTrajectory, match="did not return document"):
        chain_trajectory(task, lambda call: "Page 1: nothing relevant", random.Random(0), DOCS)


def test_unsupported_tool_output_is_refused_not_patched() -> None:
    import random

    with pytest.raises(UnsupportedTrajectory, match="python printed '41'"):
        math_trajectory(_task("math"), lambda call: "41", random.Random(0))
    with pytest.raises(UnsupportedTrajectory, match="did not return document"):
        qa_trajectory(_task("qa"), lambda call: "Page 1: nothing relevant", random.Random(0), DOCS)


def test_build_trajectories_rows_and_report(tmp_path: Path) -> None:
    tasks_path = tmp_path / "tasks.jsonl"
    tasks_path.write_text("".join(json.dumps(t.to_json()) + "\n" for t in GEN.tasks))
    tasks = train_tasks(tasks_path)
    assert tasks and all(t["split"] == "train" for t in tasks)  # never the test or valid split
    broken = dict(tasks[0], solution_code="print(0)") if tasks[0]["kind"] == "math" else \
        dict(tasks[0], hops=[dict(tasks[0]["hops"][0], doc_id="missing-doc")])
    report = build_trajectories([broken, *tasks[1:]], run_tool, DOCS, "tir_search_python", limit=6, seed=1)
    assert len(report.rows) == 6 and len(report.dropped) == 1 and report.dropped[0].startswith(broken["id"])
    for row, task in zip(report.rows, tasks[1:]):
        assert row["system"] == system_prompt("tir_search_python")
        assert row["conversations"][0] == {"from": "human", "value": task["question"]}
        assert check_format(row["conversations"][1]["value"]).ok
        assert row["answer"] == task["answer"]
    assert sum(report.by_kind.values()) == 6
    # same seed, same text
    again = build_trajectories([broken, *tasks[1:]], run_tool, DOCS, "tir_search_python", limit=6, seed=1)
    assert again.rows == report.rows


def test_task_file_validation(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"id": "x", "kind": "poetry", "question": "q", "answer": "a", "split": "train"}) + "\n")
    with pytest.raises(ValueError, match="row 0"):
        train_tasks(path)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "d1", "contents": "Title One\nbody"}) + "\n")
    assert corpus_docs(corpus) == {"d1": ("Title One", "body")}
