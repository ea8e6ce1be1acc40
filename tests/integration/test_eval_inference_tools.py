"""Tool-Star's rollback and refiner in evaluation, on the tiny model behind the session's vLLM server
(`vllm_endpoint`), the helper LLM being the served policy itself; their uses reach the predictions, the scores
and the report.

The refiner runs through the real inference stage (a threshold of 1 token makes it fire before the second
generation of every sample that goes on). The tiny policy never writes failing python by itself, so the rollback
sample's first reply is played back (`<python>print(1/0)` with vLLM's stop_reason); the sandbox runs that code,
the loop cuts it back, and every later generation comes from the server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from openai.types import Completion

from stages.agent.inference_tools import REFINE_PROMPT, HelperLLM, LoopAids
from stages.agent.toolbox import ToolBox
from stages.core.atomic import write_jsonl
from stages.core.env import PROJECT_ROOT
from stages.core.refs import PredictionsRef
from stages.eval.inference import eval_agent, infer_sample, load_tokenizer, loop_settings, run_inference
from stages.eval.report import build_report
from stages.eval.scoring import score_predictions
from stages.eval.serving import async_client

pytestmark = pytest.mark.integration
CACHE = PROJECT_ROOT / ".cache"


class FirstReplyPlayedBack:
    """An AsyncOpenAI stand-in whose first completion is `text` ending on the `</python>` stop (as vLLM reports
    it: the stop string cut, `stop_reason` set); every later request goes to the real server."""

    def __init__(self, client, text: str) -> None:
        self.client, self.text, self.sent = client, text, 0
        self.completions = self

    async def create(self, **body):
        self.sent += 1
        if self.sent == 1:
            return Completion.model_validate({
                "id": "played-back", "object": "text_completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "text": self.text, "finish_reason": "stop", "logprobs": None,
                             "stop_reason": "</python>"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 6, "total_tokens": 7}})
        return await self.client.completions.create(**body)

    async def close(self) -> None:
        await self.client.close()


def test_rollback_and_refiner_uses_reach_the_report(vllm_endpoint, tiny_model, tiny_config, synthetic_data,
                                                    tmp_path) -> None:
    helper = {"max_tokens": 16, "timeout_s": 120.0}        # the policy as helper LLM: short replies on CPU
    agent = tiny_config.agent.model_copy(update={"inference": tiny_config.agent.inference.model_copy(update={
        "rollback": True, "refiner": True, "refine_threshold_tokens": 1, **helper})})
    cfg = tiny_config.eval.model_copy(update={"max_questions": 2, "samples": 1, "max_tokens": 8,
                                              "max_total_tokens": 24})
    # 1. the refiner through the inference stage: every sample that goes on past its first 8 tokens is refined
    #    once (max_refine = 1) before its second generation
    refined = run_inference(cfg, agent, "synthetic", tiny_model, vllm_endpoint, synthetic_data, tmp_path, CACHE)
    rows = [json.loads(line) for line in Path(refined.path).read_text().splitlines()]
    assert [r["inference_tools"]["refine"] for r in rows] == [int(r["llm_calls"] > 1) for r in rows]
    assert sum(r["inference_tools"]["refine"] for r in rows) >= 1 and all(r["error"] is None for r in rows)
    # the helper is the served policy, over the chat API: it answers (a failed helper keeps the original text)
    llm = HelperLLM.from_config(agent.inference, vllm_endpoint.url, vllm_endpoint.model)
    assert llm.complete(REFINE_PROMPT.format(question="1+1?", response="<think>one plus one</think>")).strip()

    # 2. the rollback on the real server: the played-back failing call is run, cut back and regenerated
    item = synthetic_item(synthetic_data)
    tokenizer = load_tokenizer(tiny_model)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": item.question}], tokenize=False,
                                           add_generation_prompt=True)
    client = FirstReplyPlayedBack(async_client(vllm_endpoint), "<think>\nI will divide.\n</think>\n<python>print(1/0)")
    box = ToolBox.from_config(eval_agent(cfg, agent), synthetic_data.files["corpus"], str(CACHE))
    aids = LoopAids(agent.inference, None, lambda text: len(tokenizer.encode(text)), prompt, item.question)

    async def one_sample():
        try:
            return await infer_sample(client, loop_settings(cfg, vllm_endpoint), 300.0, prompt, box, item, 0,
                                      "synthetic", "played-back", [], aids)
        finally:
            await client.close()

    try:
        row = asyncio.run(one_sample())
    finally:
        box.close()
    assert row.inference_tools == {"debug": 0, "rollback": 1, "refine": 0}
    # Tool-Star's cut: back over the call, "</think>" and the line "I will divide." to "<think>\n"; the error
    # is never shown and the server writes on from there
    assert "print(1/0)" not in row.output and "ZeroDivisionError" not in row.output
    assert row.output.startswith("<think>\n") and row.llm_calls >= 2 and client.sent == row.llm_calls

    # 3. both counted in the scores and the report
    played = tmp_path / "played" / "predictions.jsonl"
    write_jsonl(played, [row.model_dump()])
    scores = [score_predictions(cfg, ref, None, tmp_path, CACHE) for ref in
              (refined, PredictionsRef(path=str(played), fingerprint="played-back", benchmark="synthetic"))]
    assert scores[0].meta["refine_uses"] >= 1 and scores[1].meta["rollback_uses"] == 1
    report = build_report(cfg, scores, tmp_path)
    assert [(r["refine_uses"], r["rollback_uses"]) for r in report.meta["rows"]] == \
        [(scores[0].meta["refine_uses"], 0), (0, 1)]
    assert "rollback_uses" in Path(report.meta["markdown"]).read_text()


def synthetic_item(data):
    from stages.eval.benchmarks import load_benchmark

    return load_benchmark("synthetic", "", cap=1, synthetic_path=data.files["eval_test"]).items[0]
