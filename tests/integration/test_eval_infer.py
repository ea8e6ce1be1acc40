"""Inference end to end on the tiny model behind vLLM's server (the session fixture `vllm_endpoint`): real benchmarks
(EVAL-B's loaders over
../shared/data/eval) and the generated synthetic set, the tool path through the real ToolBox, and a run
killed by SIGKILL midway whose rerun completes only the missing samples."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stages.agent.loop import TextSegment, run_text_loop
from stages.core.codeversion import code_version
from stages.core.env import PROJECT_ROOT
from stages.core.refs import EndpointRef
from stages.eval.agent_loop import EVAL_STOPS, SampleState
from stages.eval.inference import FINAL, PARTIAL, eval_agent, loop_settings, run_inference
from stages.eval.reuse import finished_inference
from stages.eval.serving import expected_endpoint

pytestmark = pytest.mark.integration
FIELDS = {"id", "benchmark", "sample", "question", "golds", "task_type", "prediction", "output", "finish_reason",
          "tool_calls", "timing", "timed_out", "error", "model", "benchmark_hash"}


@pytest.fixture(scope="module")
def endpoint(vllm_endpoint):
    return vllm_endpoint


@pytest.fixture(scope="module")
def small_eval(tiny_config):
    # short generations: the tiny model rarely follows the protocol, the loop and the file format are tested
    return tiny_config.eval.model_copy(update={"max_questions": 2, "samples": 1, "max_tokens": 12,
                                               "max_total_tokens": 24, "concurrency": 4,
                                               "data_root": str(PROJECT_ROOT.parent / "shared" / "data" / "eval")})


def read_rows(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_real_benchmarks_and_synthetic_end_to_end(endpoint, tiny_model, tiny_config, synthetic_data, shared_data,
                                                  small_eval, tmp_path) -> None:
    from stages.eval.benchmarks import load_benchmark

    for name, samples in (("synthetic", 2), ("gsm8k", 1), ("hotpotqa", 1), ("aime24", 1)):
        cfg = small_eval.model_copy(update={"samples": samples, "max_total_tokens": 12})   # one call per sample
        ref = run_inference(cfg, tiny_config.agent, name, tiny_model, endpoint, synthetic_data, tmp_path,
                            PROJECT_ROOT / ".cache")
        rows = read_rows(ref.path)
        loaded = load_benchmark(name, cfg.data_root, cap=2,
                                synthetic_path=synthetic_data.file("eval_test") if name == "synthetic" else None)
        # 2 questions x `samples`, in benchmark order then by sample
        assert [(r["id"], r["sample"]) for r in rows] == [(i.id, s) for i in loaded.items for s in range(samples)]
        assert ref.benchmark == name and ref.meta["rows"] == 2 * samples
        for row, item in zip(rows, [i for i in loaded.items for _ in range(samples)]):
            assert FIELDS <= set(row)
            assert row["golds"] == list(item.golds) and row["question"] == item.question
            assert row["task_type"] == item.task_type and row["benchmark_hash"] == loaded.content_hash
            assert row["model"] == endpoint.model and row["error"] is None and not row["timed_out"]
            assert row["finish_reason"] in ("stop", "length")
            assert 0 < row["completion_tokens"] <= 12                     # eval.max_total_tokens holds
            assert set(row["tool_calls"]) == {"python", "search"}
            assert row["timing"]["total_s"] >= row["timing"]["llm_s"] > 0
        assert not (Path(ref.path).parent / PARTIAL).exists()          # folded into the final file
        again = run_inference(cfg, tiny_config.agent, name, tiny_model, endpoint, synthetic_data, tmp_path,
                              PROJECT_ROOT / ".cache")
        assert again == ref                                             # complete: reused, not rerun
        # a rerun sees these predictions before serving anything (the pipeline then starts no server); it plans
        # the server the session fixture started (served as "smol": the rows name what answered)
        planned = expected_endpoint(tiny_config.serve.model_copy(update={"served_name": "smol"}), tiny_model)
        assert finished_inference(cfg, tiny_config.agent, name, tiny_model, planned, synthetic_data,
                                  tmp_path) == ref.fingerprint


def test_tool_calls_run_through_the_toolbox_with_limit_feedback(tiny_config, synthetic_data) -> None:
    from stages.agent.protocol import LIMIT_MESSAGES
    from stages.agent.toolbox import ToolBox

    cfg = tiny_config.eval.model_copy(update={"max_python": 1, "max_search": 1})
    box = ToolBox.from_config(eval_agent(cfg, tiny_config.agent), synthetic_data.files["corpus"],
                              str(PROJECT_ROOT / ".cache"))
    try:
        first_entity = json.loads(Path(synthetic_data.files["corpus"]).read_text().splitlines()[0])
        query = first_entity["contents"].split()[0]
        segments = ["<think>compute</think><python>print(6*7)</python>",
                    "<python>print(1)</python>",                           # a second call: over max_python=1
                    f"<search>{query}</search>", "done"]

        async def scripted(output: str, max_tokens: int, call: int) -> TextSegment:  # the model, played back
            text = segments[call]
            stop = next((s for s in EVAL_STOPS if text.endswith(s)), None)
            return TextSegment(text, "stop" if stop else "eos", stop, 1)

        state = SampleState()
        settings = loop_settings(cfg, EndpointRef(url="http://unused/v1", model="m"))
        asyncio.run(run_text_loop(scripted, box, settings.rules, settings.budget, state))
        results = state.output.split(" <result>\n")
        assert results[1].startswith("42\n</result>")                      # 6*7 = 42, in the training form
        assert results[2].startswith(f"{LIMIT_MESSAGES['python']}\n</result>")
        assert query in results[3]                                          # the corpus passage came back
        assert state.output.endswith("</result>done") and state.finish_reason == "stop"
        assert state.tools_run == {"python": 2, "search": 1}
        assert state.timing["python_s"] > 0 and state.timing["search_s"] > 0
    finally:
        box.close()


KILLED_RUN = """
import json, sys
from stages.core.config.loader import load_config
from stages.core.refs import DatasetRef, EndpointRef, ModelRef
from stages.eval.inference import run_inference
args = json.loads(sys.argv[1])
cfg = load_config("tiny-cpu").eval.model_validate(args["cfg"])
run_inference(cfg, load_config("tiny-cpu").agent, "synthetic", ModelRef(**args["model"]),
              EndpointRef(**args["endpoint"]), DatasetRef(**args["data"]), args["out"], args["cache"])
"""


def test_killed_run_resumes_without_recomputing_finished_samples(endpoint, tiny_model, tiny_config,
                                                                  synthetic_data, small_eval, tmp_path) -> None:
    # 4 samples run one at a time; each may take two calls (12 tokens per call, 24 per sample)
    cfg = small_eval.model_copy(update={"max_questions": 2, "samples": 2, "concurrency": 1})
    args = {"cfg": cfg.model_dump(mode="json"), "model": tiny_model.model_dump(mode="json"),
            "endpoint": endpoint.model_dump(mode="json"), "data": synthetic_data.model_dump(mode="json"),
            "out": str(tmp_path), "cache": str(PROJECT_ROOT / ".cache")}
    run = subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILLED_RUN), json.dumps(args)], cwd=PROJECT_ROOT,
                           env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    partial: list[Path] = []
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and run.poll() is None:
            partial = list(tmp_path.glob(f"infer/*/{PARTIAL}"))
            if partial and len(partial[0].read_text().splitlines()) >= 1:
                break
            time.sleep(0.2)
        os.kill(run.pid, signal.SIGKILL)
    finally:
        run.wait()
    assert partial, "the killed run never wrote a finished sample"
    before = {(r["id"], r["sample"]): r for r in read_rows(partial[0])}
    assert 1 <= len(before) < 4                                   # killed midway
    assert not (partial[0].parent / FINAL).exists()
    code_version.cache_clear()  # the key hashes the code as it is on disk now, as the killed run did
    ref = run_inference(cfg, tiny_config.agent, "synthetic", tiny_model, endpoint, synthetic_data, tmp_path,
                        PROJECT_ROOT / ".cache")
    assert Path(ref.path).parent == partial[0].parent, "stage key changed between the runs (code edited meanwhile?)"
    rows = read_rows(ref.path)
    assert len(rows) == 4 and len({(r["id"], r["sample"]) for r in rows}) == 4
    for row in rows:                                              # finished samples kept byte for byte
        if (row["id"], row["sample"]) in before:
            assert row == before[(row["id"], row["sample"])]
    summary = json.loads((Path(ref.path).parent / "summary.json").read_text())
    assert summary["ran_this_time"] == 4 - len(before)            # only the missing ones ran


def test_cancelled_sample_keeps_its_partial_output(endpoint, tiny_model, tiny_config) -> None:
    """asyncio.timeout cancels run_sample; what the finished calls produced stays on the state."""
    from transformers import AutoTokenizer

    from stages.agent.prompt_templates import build_messages
    from stages.agent.toolbox import ToolBox
    from stages.eval.agent_loop import LoopSettings, run_sample
    from stages.eval.serving import async_client

    prompt = AutoTokenizer.from_pretrained(tiny_model.path).apply_chat_template(
        build_messages("Explain step by step how to compute 123 * 456."), tokenize=False, add_generation_prompt=True)
    settings = LoopSettings(model=endpoint.model, max_tokens=2, max_total_tokens=400, temperature=0.0, top_p=1.0,
                            extras={}, max_llm_calls=200)
    state = SampleState()

    async def go() -> None:
        client = async_client(endpoint)
        box = ToolBox.from_config(tiny_config.agent, None, str(PROJECT_ROOT / ".cache"), tools=())  # no tools
        task = asyncio.create_task(run_sample(client, settings, prompt, box, 0, state))
        while state.llm_calls < 2 and not task.done():  # noqa: ASYNC110 - polls a plain counter
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await client.close()
        box.close()

    asyncio.run(go())
    assert state.llm_calls >= 2 and state.output != ""             # two calls of 2 tokens each were kept
    assert state.completion_tokens == 2 * state.llm_calls          # each call hit its max_tokens (no EOS yet)


def test_timed_out_sample_is_recorded_as_such(endpoint, tiny_model, tiny_config, synthetic_data, small_eval,
                                              tmp_path) -> None:
    cfg = small_eval.model_copy(update={"max_questions": 1, "sample_timeout_s": 0.01})
    ref = run_inference(cfg, tiny_config.agent, "synthetic", tiny_model, endpoint, synthetic_data, tmp_path,
                        PROJECT_ROOT / ".cache")
    (row,) = read_rows(ref.path)
    assert row["timed_out"] is True and row["finish_reason"] == "timeout" and row["error"] is None
    assert ref.meta["timed_out"] == 1


def test_unreachable_server_fails_and_keeps_nothing_half_done(tiny_model, tiny_config, synthetic_data, small_eval,
                                                              tmp_path) -> None:
    from stages.core.procs import free_port
    from stages.core.refs import EndpointRef
    from stages.eval.inference import InferenceIncomplete

    dead = EndpointRef(url=f"http://127.0.0.1:{free_port()}/v1", model="smol", meta={"sampling_extras": True})
    with pytest.raises(InferenceIncomplete, match=r"2 of 2 synthetic samples could not reach.*rerun"):
        run_inference(small_eval, tiny_config.agent, "synthetic", tiny_model, dead, synthetic_data, tmp_path,
                      PROJECT_ROOT / ".cache")
    (partial,) = tmp_path.glob(f"infer/*/{PARTIAL}")
    assert partial.read_text() == "" and not (partial.parent / FINAL).exists()


def test_switching_endpoints_recomputes_moving_one_does_not(endpoint, tiny_model, tiny_config, synthetic_data,
                                                            small_eval, tmp_path, prefect_harness) -> None:
    from prefect import flow

    from stages.core.selection import select_stages
    from tasks.eval_infer import infer_task
    from tasks.stage_tasks import run_stage

    cfg = small_eval.model_copy(update={"max_questions": 1})

    @flow
    def infer(served: EndpointRef, refresh: bool) -> tuple[str, str]:
        state = run_stage(infer_task, select_stages(refresh=["infer"] if refresh else []), cfg,
                          tiny_config.agent, "synthetic", tiny_model, served, synthetic_data, str(tmp_path),
                          str(PROJECT_ROOT / ".cache"), return_state=True)
        return state.name, state.result().fingerprint

    first = infer(endpoint, False)
    assert first[0] == "Completed"
    # the same server elsewhere (another port, pid): what it computes is the same -> Prefect's cache answers
    moved = endpoint.model_copy(update={"url": "http://127.0.0.1:1/v1", "meta": {**endpoint.meta, "pid": 1}})
    assert infer(moved, False) == ("Cached", first[1])
    # a server without vLLM's sampling extras samples differently: the key changes, inference runs again
    plain = endpoint.model_copy(update={"meta": {**endpoint.meta, "sampling_extras": False}})
    second = infer(plain, False)
    assert second[0] == "Completed" and second[1] != first[1]
    assert infer(plain, False) == ("Cached", second[1])
    # --refresh flips one switch: Prefect recomputes, the stage folder is rebuilt (a new fingerprint)
    refreshed = infer(plain, True)
    assert refreshed[0] == "Completed" and refreshed[1] != second[1]
    assert infer(plain, False) == ("Cached", refreshed[1])
