"""Inference pieces without a server: which stop ended a generation, resumable partial files, the stage key
and the Prefect cache policy (which must ignore the endpoint's URL)."""

from __future__ import annotations

import json
from pathlib import Path

from openai.types import CompletionChoice

from stages.core.config.agent import AgentSection
from stages.core.config.eval import EvalSection
from stages.core.refs import DatasetRef, EndpointRef, ModelRef
from stages.eval.agent_loop import EVAL_STOPS, LoopSettings, matched_stop
from stages.eval.inference import append_row, eval_agent, inference_key, read_partial, sample_seed, sampling_extras

MODEL = ModelRef(path="/m", fingerprint="a" * 16, name="smol")
DATA = DatasetRef(path="/d", fingerprint="d" * 16, files={"eval_test": "/d/e.jsonl", "corpus": "/d/c.jsonl"})
CPU = EndpointRef(url="http://127.0.0.1:4000/v1", model="smol", meta={"sampling_extras": True})


def choice(text: str, finish: str = "stop", **extra) -> CompletionChoice:
    return CompletionChoice.model_validate({"index": 0, "text": text, "finish_reason": finish, "logprobs": None,
                                            **extra})


def test_stop_reason_from_the_server_is_trusted() -> None:
    assert matched_stop(choice("<search>x", stop_reason="</search>"), "<search>x", "", EVAL_STOPS) == \
        ("<search>x", "</search>")
    # EOS: stop_reason present but None -> no stop string, even with an open tag
    assert matched_stop(choice("<python>x", stop_reason=None), "<python>x", "", EVAL_STOPS) == ("<python>x", None)
    assert matched_stop(choice("abc", "length", stop_reason=None), "abc", "", EVAL_STOPS) == ("abc", None)


def test_server_that_ignores_stops_is_cut_at_the_first_tag() -> None:
    # reference bug 8.5.4: stops never reached the server; everything after the first stop tag is dropped
    text = "<python>print(1)</python> <result>\n1\n</result><answer>1</answer>"
    assert matched_stop(choice(text, "length"), text, "", EVAL_STOPS) == ("<python>print(1)", "</python>")


def test_server_without_stop_reason_is_read_from_the_open_tag() -> None:
    assert matched_stop(choice("<think>t</think><search>q"), "<think>t</think><search>q", "", EVAL_STOPS) == \
        ("<think>t</think><search>q", "</search>")
    assert matched_stop(choice("<answer>\\boxed{3}"), "<answer>\\boxed{3}", "", EVAL_STOPS) == \
        ("<answer>\\boxed{3}", "</answer>")
    assert matched_stop(choice("done."), "done.", "", EVAL_STOPS) == ("done.", None)        # plain EOS
    assert matched_stop(choice("abc", "length"), "abc", "", EVAL_STOPS) == ("abc", None)


def test_request_sends_stops_and_extras() -> None:
    settings = LoopSettings(model="smol", max_tokens=64, max_total_tokens=128, temperature=0.6, top_p=0.95,
                            extras={"top_k": 20}, max_llm_calls=10)
    body = settings.request("P", 32, 7)
    assert body["stop"] == ["</search>", "</python>", "</answer>"]
    assert body["extra_body"] == {"top_k": 20} and body["max_tokens"] == 32 and body["seed"] == 7


def test_sampling_extras_only_for_servers_that_accept_them() -> None:
    cfg = EvalSection(top_k=20, min_p=0.0, repetition_penalty=1.1)
    assert sampling_extras(cfg, CPU) == {"top_k": 20, "min_p": 0.0, "repetition_penalty": 1.1}
    external = EndpointRef(url="https://api.example.com/v1", model="gpt", meta={"sampling_extras": False})
    assert sampling_extras(cfg, external) == {}


def test_eval_limits_replace_the_agent_limits() -> None:
    agent = eval_agent(EvalSection(max_python=5, max_search=10), AgentSection())
    assert (agent.limits.max_python, agent.limits.max_search, agent.limits.max_calls) == (5, 10, 15)


def test_partial_file_resumes_and_drops_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    with open(path, "a", encoding="utf-8") as handle:
        append_row(handle, {"id": "q1", "sample": 0, "output": "a"})
        append_row(handle, {"id": "q1", "sample": 1, "output": "b"})
        handle.write('{"id": "q2", "sam')               # the process died mid-write
    done = read_partial(path)
    assert sorted(done) == [("q1", 0), ("q1", 1)]
    assert path.read_text().count("\n") == 2 and path.read_text().endswith("}\n")   # torn line cut off
    with open(path, "a", encoding="utf-8") as handle:   # appending after the repair gives valid JSONL
        append_row(handle, {"id": "q2", "sample": 0, "output": "c"})
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["q1", "q1", "q2"]
    assert read_partial(tmp_path / "missing.jsonl") == {}


def test_sample_seeds_are_stable_and_distinct() -> None:
    assert sample_seed("gsm8k", "q1", 0) == sample_seed("gsm8k", "q1", 0)
    assert len({sample_seed("gsm8k", "q1", s) for s in range(5)} | {sample_seed("aime24", "q1", 0)}) == 6


def test_stage_key_ignores_concurrency_judge_and_url_but_not_sampling() -> None:
    cfg = EvalSection()
    base = inference_key(cfg, AgentSection(), "gsm8k", "h", MODEL, CPU, DATA)
    moved = CPU.model_copy(update={"url": "http://127.0.0.1:5000/v1"})
    assert inference_key(cfg.model_copy(update={"concurrency": 1, "pass_k": [1, 5]}), AgentSection(), "gsm8k", "h",
                         MODEL, moved, DATA) == base
    assert inference_key(cfg.model_copy(update={"temperature": 0.0}), AgentSection(), "gsm8k", "h", MODEL, CPU,
                         DATA) != base
    assert inference_key(cfg, AgentSection(), "gsm8k", "h2", MODEL, CPU, DATA) != base          # data changed
    other = MODEL.model_copy(update={"fingerprint": "b" * 16})
    assert inference_key(cfg, AgentSection(), "gsm8k", "h", other, CPU, DATA) != base           # model changed


def _infer_inputs(tmp_path: Path, **changes) -> dict:
    """The infer task's inputs over a two-question synthetic benchmark written to tmp_path."""
    test = tmp_path / "eval_test.jsonl"
    if not test.exists():
        test.write_text("".join(json.dumps({"id": f"q{i}", "question": f"{i} + 1?", "answer": str(i + 1),
                                            "kind": "math"}) + "\n" for i in range(2)))
    data = DATA.model_copy(update={"files": {"eval_test": str(test)}})
    return {"cfg": EvalSection(), "agent": AgentSection(), "benchmark": "synthetic", "model": MODEL,
            "endpoint": CPU, "data": data, "output_root": str(tmp_path / "out"), "cache_root": ".cache"} | changes


def test_infer_task_cache_is_the_stage_key(tmp_path: Path) -> None:
    from stages.core.workspace import stage_dir
    from stages.eval.inference import STAGE, infer_key
    from tasks.eval_infer import infer_task

    policy = infer_task.cache_policy
    inputs = _infer_inputs(tmp_path)
    key = policy.compute_key(None, inputs, {})
    # the Prefect key is the stage folder's key (+ the folder's root): they change together
    folder = stage_dir(inputs["output_root"], STAGE, infer_key(**{k: v for k, v in inputs.items()
                                                                  if k not in ("output_root", "cache_root")}))
    assert policy.compute_key(None, _infer_inputs(tmp_path, output_root=str(tmp_path / "elsewhere")), {}) != key
    assert folder.path.parent.parent == (tmp_path / "out").resolve()
    # where the server runs (URL, port, pid) is not what it computes: the same key
    moved = CPU.model_copy(update={"url": "http://127.0.0.1:5000/v1", "meta": {"sampling_extras": True, "pid": 2}})
    assert policy.compute_key(None, _infer_inputs(tmp_path, endpoint=moved), {}) == key
    # switching the endpoint to one without vLLM's sampling extras, or serving another model, recomputes
    plain = CPU.model_copy(update={"meta": {"sampling_extras": False}})
    other_name = CPU.model_copy(update={"model": "smol-dpo"})
    other_weights = CPU.model_copy(update={"model_fingerprint": "e" * 16})
    for endpoint in (plain, other_name, other_weights):
        assert policy.compute_key(None, _infer_inputs(tmp_path, endpoint=endpoint), {}) != key, endpoint
    other = MODEL.model_copy(update={"fingerprint": "b" * 16})
    assert policy.compute_key(None, _infer_inputs(tmp_path, model=other), {}) != key


def test_infer_task_cache_ignores_scoring_settings_but_not_generation_ones(tmp_path: Path) -> None:
    from stages.core.config.eval import JudgeSection
    from tasks.eval_infer import infer_task

    policy, cfg = infer_task.cache_policy, EvalSection()
    key = policy.compute_key(None, _infer_inputs(tmp_path), {})
    rescoring = cfg.model_copy(update={"judge": JudgeSection(enabled=False), "pass_k": [1, 4], "bootstrap_seed": 3,
                                       "concurrency": 2})
    assert policy.compute_key(None, _infer_inputs(tmp_path, cfg=rescoring), {}) == key
    for field, value in (("temperature", 0.0), ("samples", 4), ("max_tokens", 64), ("max_search", 1),
                         ("max_questions", 1)):  # max_questions: fewer questions, another content hash
        changed = cfg.model_copy(update={field: value})
        assert policy.compute_key(None, _infer_inputs(tmp_path, cfg=changed), {}) != key, field
