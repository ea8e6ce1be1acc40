from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from stages.core.config.section import Section, registry, used_when
from stages.core.config.serve import ServeSection


class JudgeSection(Section):
    """LLM-as-judge. `policy` reuses the served policy model; otherwise the judge is served per `serve`."""

    enabled: bool = Field(True, description="score with the judge's llm_equal besides the rule metrics; false = "
                          "rule-only scoring (math_equal for math, em for QA) and no judge is served")
    model: Literal["policy", "path"] = Field(
        "policy", description="policy = the served policy judges its own answers (no second server); path = the "
        "model at `path`, served per `serve`")
    path: str | None = Field(None, description="judge model folder or hub id (model=path)",
                             json_schema_extra=used_when(model="path"))
    serve: ServeSection = ServeSection()
    max_retries: int = Field(3, ge=1, description="attempts per judge call (tenacity, exponential backoff)")
    retry_backoff_s: float = Field(1.0, gt=0, description="first backoff wait; doubles per attempt, max 30 s")
    concurrency: int = Field(4, ge=1, description="judge calls in flight at once")
    temperature: float = Field(0.0, ge=0, description="judge sampling temperature (0 = deterministic verdicts)")
    max_tokens: int = Field(256, ge=1, description="judge reply budget (a thinking judge needs more)")
    timeout_s: float = Field(120.0, gt=0, description="HTTP timeout per judge call")

    @model_validator(mode="after")
    def _path_model_needs_path(self) -> JudgeSection:
        if self.enabled and self.model == "path" and not self.path:
            raise ValueError("eval.judge.model=path needs eval.judge.path (a model folder, a hub id, or the model "
                             "name an external judge server knows)")
        return self


class HeldoutSection(Section):
    """What each stage bought: the base, SFT and RL policies evaluated in process on one held-out split of the data
    stage, side by side in the eval report (stage `heldout`; stages/heldout/stage.py, docs/eval.md)."""

    enabled: bool = Field(False, description="evaluate base, SFT and RL policies on the held-out split (stage "
                                             "`heldout`) and show them side by side in the report")

    split: Literal["eval_test", "rl_valid"] = Field(
        "eval_test", description="data stage file: eval_test (the generated test split: question/answer/kind) or "
                                 "rl_valid (verl parquet, its own system prompt)")
    max_questions: int | None = Field(None, ge=1, description="the first N questions of the split (None = all)")
    samples: int = Field(1, ge=1, description="trajectories per question")
    temperature: float = Field(0.0, ge=0, description="0 = greedy")
    max_response_length: int = Field(512, ge=8, description="response tokens per trajectory, tool results included")
    max_prompt_length: int = Field(1536, ge=8, description="prompt tokens per trajectory")
    call_limit: int = Field(3, ge=0, description="tool calls per trajectory")
    reward: str = Field("reference", description="reward function that decides `correct`",
                        json_schema_extra=registry("reward function"))
    questions_per_batch: int = Field(16, ge=1, description="questions rolled out together")
    backend: str = Field(
        "transformers", description="generation backend (vllm: in-process, under vLLM's interpreter, like "
        "rl.rollout.backend)", json_schema_extra=registry("generation backend"))
    confidence: float = Field(0.95, gt=0, lt=1, description="bootstrap interval level")
    bootstrap_samples: int = Field(2000, ge=100, description="bootstrap resamples (over questions) per interval")
    seed: int = Field(0, description="seed of the rollouts and of the bootstrap resampling")


class EvalSection(Section):
    """The evaluation: serve the policy, run the agent over each benchmark, score and report (stages infer, score,
    report; docs/eval.md)."""

    enabled: bool = Field(True, description="false = the evaluation is skipped (no server, infer, score or report); "
                          "stage_gains has its own switch")
    benchmarks: list[str] = Field(default_factory=lambda: ["synthetic"], description="benchmarks to evaluate on "
                                  "(stages/eval/benchmarks.py)", json_schema_extra=registry("benchmark"))
    data_root: str = Field("../shared/data/eval", description="folder with <benchmark>/test.jsonl files")
    max_questions: int | None = Field(None, ge=1, description="cap per benchmark; None = benchmark default")
    samples: int = Field(1, ge=1, description="samples per question (k for pass@k)")
    pass_k: list[int] = Field(default_factory=lambda: [1], description="k of each pass@k (1 <= k <= samples)")
    temperature: float = Field(0.6, ge=0, description="sampling temperature of the policy's answers (the "
                               "reference's evaluation: 0.6)")
    top_p: float = Field(0.95, gt=0, le=1, description="nucleus sampling of the policy's answers (the reference's "
                         "evaluation: 0.95)")
    top_k: int = Field(20, ge=-1, description="sent when the server accepts it (vllm); 0 or -1 = off")
    min_p: float = Field(0.0, ge=0, le=1, description="sent when the server accepts it (vllm)")
    repetition_penalty: float = Field(1.1, gt=0, description="sent when the server accepts it; 1.0 = off")
    max_tokens: int = Field(4096, ge=1, description="tokens per generation call")
    max_total_tokens: int = Field(8192, ge=1, description="response budget per sample across calls")
    concurrency: int = Field(8, ge=1, description="samples of one benchmark in flight at once against the policy "
                             "server")
    fanout: Literal["threads", "ray"] = Field(
        "threads", description="how per-benchmark inference + scoring fan out: threads here, or Ray workers "
                               "(prefect-ray RayTaskRunner; a local Ray unless ray_address is set)")
    ray_address: str | None = Field(None, description="existing Ray cluster, e.g. ray://head:10001",
                                    json_schema_extra=used_when(fanout="ray"))
    ray_num_cpus: int | None = Field(None, ge=1, description="CPUs for a local Ray; None = all",
                                     json_schema_extra=used_when(fanout="ray"))
    sample_timeout_s: float = Field(1500.0, gt=0, description="wall-clock limit per sample")
    max_python: int = Field(5, ge=0, description="python calls per sample")
    max_search: int = Field(10, ge=0, description="search calls per sample")
    browse: list[str] = Field(
        default_factory=list, description="benchmarks whose searches browse the result pages here, as the reference's "
        "deep-search mode did (agent.search.browse settings; summarised when agent.search.summarizer.model is set), "
        "each in its own language variant (xbench: zh, stages/eval/benchmarks.py); training keeps "
        "agent.search.browse.enabled (docs/eval.md, \"Search mode per benchmark\")",
        json_schema_extra=registry("benchmark"))
    benchmark_prompts: bool = Field(
        True, description="a benchmark with its own system prompt in the reference (xbench: Chinese, "
        "configs/templates/tir_search_python_zh.txt) uses it when it offers the same tools as agent.prompt_template; "
        "false = agent.prompt_template everywhere")
    judge: JudgeSection = JudgeSection()
    bootstrap_samples: int = Field(1000, ge=10, description="bootstrap resamples (over questions) per CI")
    bootstrap_seed: int = Field(0, description="seed of the bootstrap resampling")
    confidence: float = Field(0.95, gt=0, lt=1, description="confidence level of the bootstrap intervals")
    math_workers: int = Field(2, ge=1, description="processes that run math-verify (its timeouts need a main thread)")
    stage_gains: HeldoutSection = Field(default_factory=HeldoutSection,
                                        description="base vs SFT vs RL on one held-out split (stage `heldout`)")
    reference_setting: str | None = Field(
        None, description="published setting shown beside ours in the report, a key of "
                          "stages/eval/reference_numbers.yaml (e.g. arpo-qwen3-14b); None = all settings listed")

    @model_validator(mode="after")
    def _pass_k_within_samples(self) -> EvalSection:
        bad = [k for k in self.pass_k if not 1 <= k <= self.samples]
        if bad:
            raise ValueError(f"eval.pass_k={self.pass_k} has k={bad[0]} but pass@k needs 1 <= k <= eval.samples="
                             f"{self.samples}; raise eval.samples or drop that k")
        return self
