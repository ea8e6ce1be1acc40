"""The inference stage: every (question, sample) of one benchmark through the agent loop, resumably.

`run_inference` writes `<output_root>/infer/<key>/predictions.jsonl`, one row per (item, sample) in
the predictions contract (docs/eval.md). Finished samples are appended to `predictions.partial.jsonl` one
line at a time (flushed and fsynced), so a rerun after a crash runs only the missing (id, sample) pairs;
the final file is written atomically once every pair is done. Samples that could not reach the server
are not written, and the stage then fails naming how many, so the next run retries exactly those. Its
summary.json records what produced the predictions (`provenance`: stages/eval/provenance.py), for the report.

A sample whose tool calls hit an infrastructure failure (the search provider, retrieval server or sandbox failed:
`ToolResult.fault == "infra"`) is not the model's answer: its row says so (`infra_failures`, `infra_errors`), the
stage completes (scoring leaves it out of the metrics and the report lists it), and the marker records how many
(`infra_failed`). The next call on a folder with such rows reopens it (`reopen_infra_failed`): every other row is
kept as finished, and only those samples run again (the pipeline's rerun does this: stages/eval/reuse.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from stages.core.atomic import write_json, write_jsonl
from stages.core.codeversion import code_version
from stages.core.config.agent import AgentSection
from stages.core.config.eval import EvalSection
from stages.core.fingerprint import hash_value
from stages.core.log import get_logger
from stages.core.refs import DatasetRef, EndpointRef, ModelRef, PredictionsRef
from stages.core.reporter import track
from stages.core.workspace import stage_dir
from stages.eval.agent_loop import LoopSettings, SampleState, run_sample
from stages.eval.provenance import inference_record
from stages.eval.rows import PredictionRow
from stages.eval.search_mode import benchmark_search, check_summarizer, keyed_agent, search_mode, summarizer_search

log = get_logger(__name__)

STAGE = "infer"
FINAL = "predictions.jsonl"
PARTIAL = "predictions.partial.jsonl"
GENERATION_KEYS = {"data_root", "max_questions", "samples", "temperature", "top_p", "top_k", "min_p",
                   "repetition_penalty", "max_tokens", "max_total_tokens", "sample_timeout_s", "max_python",
                   "max_search", "benchmark_prompts"}


class InferenceIncomplete(RuntimeError):
    """Some samples failed to reach the server; the finished ones are kept for the rerun."""


def sampling_extras(cfg: EvalSection, endpoint: EndpointRef) -> dict[str, Any]:
    """vLLM's extra sampling fields, sent only to servers that accept them (ARPO eval bug 8.5.4 never sent them)."""
    if not endpoint.meta.get("sampling_extras", False):
        return {}
    return {"top_k": cfg.top_k, "min_p": cfg.min_p, "repetition_penalty": cfg.repetition_penalty}


def eval_agent(cfg: EvalSection, agent: AgentSection) -> AgentSection:
    """The agent settings with the evaluation's per-tool limits (eval.max_python / eval.max_search)."""
    limits = agent.limits.model_copy(update={"max_python": cfg.max_python, "max_search": cfg.max_search,
                                             "max_calls": cfg.max_python + cfg.max_search})
    return agent.model_copy(update={"limits": limits})


def benchmark_agent(cfg: EvalSection, agent: AgentSection, benchmark: str) -> AgentSection:
    """The agent as this benchmark runs it: the evaluation's limits and the benchmark's search (browsing where
    eval.browse names it, in its own language variant; stages/eval/search_mode.py)."""
    evaluated = eval_agent(cfg, agent)
    return evaluated.model_copy(update={"search": benchmark_search(cfg, evaluated.search, benchmark)})


def benchmark_template(cfg: EvalSection, agent: AgentSection, benchmark: str) -> str:
    """The system prompt template this benchmark runs with (its own, e.g. xbench's Chinese one, or the run's)."""
    from stages.eval.benchmarks import get_spec, prompt_template_for

    return prompt_template_for(get_spec(benchmark), agent.prompt_template, cfg.benchmark_prompts)


def inference_key(cfg: EvalSection, agent: AgentSection, benchmark: str, content_hash: str, model: ModelRef,
                  endpoint: EndpointRef, data: DatasetRef) -> str:
    """What the predictions depend on: the generation settings (not the judge, pass@k or bootstrap, which only
    rescore), the agent, the benchmark's content, the model, what answers at the endpoint (served name + weights,
    never its URL) and the sampling extras it accepts, the corpus, the prompt and the code. The summariser counts by
    what it is (its served name, `path`, sampling), never by where it runs (`keyed_agent`)."""
    from stages.agent.prompt_templates import system_prompt

    corpus = agent.search.corpus_path or (data.fingerprint if "corpus" in data.files else None)
    template = benchmark_template(cfg, agent, benchmark)
    return hash_value(cfg.model_dump(include=GENERATION_KEYS), keyed_agent(benchmark_agent(cfg, agent, benchmark)),
                      benchmark, content_hash, model.fingerprint, endpoint.identity, corpus,
                      sampling_extras(cfg, endpoint), template, system_prompt(template), code_version(__name__))


def load(cfg: EvalSection, benchmark: str, data: DatasetRef) -> Any:
    from stages.eval.benchmarks import load_benchmark

    synthetic = data.files.get("eval_test") if benchmark == "synthetic" else None
    return load_benchmark(benchmark, cfg.data_root, cap=cfg.max_questions, synthetic_path=synthetic)


def infer_key(cfg: EvalSection, agent: AgentSection, benchmark: str, model: ModelRef, endpoint: EndpointRef,
              data: DatasetRef) -> str:
    """The stage's one key (its folder name and its Prefect cache key), from the entry point's own arguments."""
    return inference_key(cfg, agent, benchmark, load(cfg, benchmark, data).content_hash, model, endpoint, data)


def sample_seed(benchmark: str, item_id: str, sample: int) -> int:
    return int(hash_value(benchmark, item_id, sample, length=8), 16)


def read_partial(path: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """Finished rows by (id, sample). A torn last line (crash mid-write) is cut off the file."""
    if not path.is_file():
        return {}
    data = path.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) != len(data):
        with open(path, "r+b") as handle:
            handle.truncate(len(whole))
    rows = [json.loads(line) for line in whole.decode("utf-8").splitlines() if line.strip()]
    return {(row["id"], int(row["sample"])): row for row in rows}


def append_row(handle: Any, row: dict[str, Any]) -> None:
    handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    handle.flush()
    os.fsync(handle.fileno())


def run_inference(cfg: EvalSection, agent: AgentSection, benchmark: str, model: ModelRef, endpoint: EndpointRef,
                  data: DatasetRef, output_root: str | Path, cache_root: str | Path,
                  force: bool = False, summarizer: EndpointRef | None = None) -> PredictionsRef:
    """`summarizer`: the endpoint of the summariser the evaluation serves (agent.search.summarizer.path,
    stages.eval.serving.start_summarizer) when this benchmark browses with one; never part of the key."""
    loaded = load(cfg, benchmark, data)
    key = inference_key(cfg, agent, benchmark, loaded.content_hash, model, endpoint, data)
    out = stage_dir(output_root, STAGE, key, force=force)
    final = out.path / FINAL
    if not out.complete:
        started = time.monotonic()
    if out.complete and out.marker().get("infra_failed"):
        reopen_infra_failed(out.path)
    if not out.complete:
        started = time.monotonic()
        rows, ran = asyncio.run(_infer_all(cfg, agent, loaded, model, endpoint, data, out.path, Path(cache_root),
                                           summarizer))
        write_jsonl(final, [row.model_dump() for row in rows])
        (out.path / PARTIAL).unlink(missing_ok=True)
        search = benchmark_agent(cfg, agent, benchmark).search
        summary = summarize(rows, ran, time.monotonic() - started, loaded, endpoint, search_mode(search))
        summary["provenance"] = inference_record(cfg, search, summary["search_mode"], model, endpoint,
                                                 sampling_extras(cfg, endpoint))  # for the report's block
        write_json(out.path / "summary.json", summary)
        if summary["infra_failed"]:
            log.warning("%s: %d of %d answers hit a tool infrastructure failure (e.g. %s); they are left out of the "
                        "metrics, and the next run retries only them", benchmark, summary["infra_failed"], len(rows),
                        next(r.infra_errors for r in rows if r.infra_failures)[:1])
        out.finish(content=final, rows=len(rows), infra_failed=summary["infra_failed"])
    summary = json.loads((out.path / "summary.json").read_text())
    return PredictionsRef(path=str(final), fingerprint=out.fingerprint, benchmark=benchmark,
                          meta={k: summary.get(k, 0) for k in ("rows", "items", "samples", "benchmark_hash", "model",
                                                               "timed_out", "errors", "infra_failed")}
                          | {"search_mode": summary.get("search_mode"), "provenance": summary.get("provenance")})


def reopen_infra_failed(folder: Path) -> int:
    """Make a finished folder resumable with its infra-failed samples missing: the other rows become the partial
    file, the marker goes (a crash in between reopens again). Returns how many samples will run again."""
    from stages.core.workspace import MARKER

    rows = [json.loads(line) for line in (folder / FINAL).read_text(encoding="utf-8").splitlines() if line.strip()]
    kept = [row for row in rows if not row.get("infra_failures")]
    write_jsonl(folder / PARTIAL, kept)
    (folder / MARKER).unlink()
    log.info("%s: %d answers hit an infrastructure failure last time; running only those again", folder,
             len(rows) - len(kept))
    return len(rows) - len(kept)


def summarize(rows: list[PredictionRow], ran: int, wall_s: float, loaded: Any, endpoint: EndpointRef,
              mode: str | None = None) -> dict[str, Any]:
    """`mode`: the search the answers were found with (search_mode.search_mode), for the report."""
    return {"search_mode": mode, "rows": len(rows), "items": len(loaded.items), "samples": len({r.sample for r in rows}),
            "benchmark": loaded.spec.name, "benchmark_hash": loaded.content_hash, "model": endpoint.model,
            "timed_out": sum(r.timed_out for r in rows), "errors": sum(r.error is not None for r in rows),
            "infra_failed": sum(r.infra_failures > 0 for r in rows),
            "ran_this_time": ran, "wall_s": round(wall_s, 3),
            "samples_per_s": round(ran / wall_s, 4) if wall_s > 0 else None,
            "mean_total_s": round(sum(r.timing["total_s"] for r in rows) / max(len(rows), 1), 3)}


async def _infer_all(cfg: EvalSection, agent: AgentSection, loaded: Any, model: ModelRef, endpoint: EndpointRef,
                     data: DatasetRef, folder: Path, cache_root: Path,
                     summarizer: EndpointRef | None = None) -> tuple[list[PredictionRow], int]:
    from stages.agent.prompt_templates import build_messages
    from stages.agent.toolbox import ToolBox, corpus_path
    from stages.eval.serving import async_client

    done = {key: PredictionRow.model_validate(row) for key, row in read_partial(folder / PARTIAL).items()}
    todo = [(item, s) for item in loaded.items for s in range(cfg.samples) if (item.id, s) not in done]
    name = loaded.spec.name
    log.info("%s: %d samples to run, %d already done (%s)", name, len(todo), len(done), folder)
    if loaded.spec.search_backend != agent.search.backend:
        log.info("%s: the reference searched with the %r backend; this run uses agent.search.backend=%r", name,
                 loaded.spec.search_backend, agent.search.backend)
    failures: list[str] = []
    evaluated = benchmark_agent(cfg, agent, name)
    log.info("%s: search mode %s", name, search_mode(evaluated.search))
    if todo:
        evaluated = evaluated.model_copy(update={"search": summarizer_search(evaluated.search, summarizer)})
        check_summarizer(evaluated.search)
        tokenizer = load_tokenizer(model)
        box = ToolBox.from_config(evaluated, corpus_path(agent, data), str(cache_root),
                                  helper_url=endpoint.url, helper_model=endpoint.model, inference_tools=True)
        client = async_client(endpoint, timeout_s=max(60.0, cfg.sample_timeout_s))
        settings = loop_settings(cfg, endpoint)
        gate = asyncio.Semaphore(cfg.concurrency)
        template = benchmark_template(cfg, agent, name)
        aids_for = loop_aids(agent, endpoint, tokenizer)

        async def one(item: Any, sample: int) -> PredictionRow | None:
            async with gate:
                prompt = tokenizer.apply_chat_template(build_messages(item.question, template),
                                                       tokenize=False, add_generation_prompt=True)
                return await infer_sample(client, settings, cfg.sample_timeout_s, prompt, box, item, sample,
                                          name, loaded.content_hash, failures, aids_for(prompt, item.question))

        try:
            with open(folder / PARTIAL, "a", encoding="utf-8") as handle, track(  # noqa: ASYNC230
                    f"infer-{name}", f"infer {name}", total=len(todo) + len(done), done=len(done),
                    unit="samples") as bar:
                for next_row in asyncio.as_completed([one(item, s) for item, s in todo]):
                    row = await next_row
                    if row is not None:
                        append_row(handle, row.model_dump())
                        done[(row.id, row.sample)] = row
                    bar.advance()
        finally:
            await close_quietly(box, client)
    if failures:
        raise InferenceIncomplete(f"{len(failures)} of {len(todo)} {name} samples could not reach the server at "
                                  f"{endpoint.url} (first: {failures[0]}); the {len(done)} finished samples are "
                                  "saved; rerun to complete only the missing ones")
    order = {item.id: i for i, item in enumerate(loaded.items)}
    return sorted(done.values(), key=lambda r: (order[r.id], r.sample)), len(todo)


def loop_aids(agent: AgentSection, endpoint: EndpointRef, tokenizer: Any) -> Any:
    """(prompt, question) -> the sample's Tool-Star rollback / refiner (None when both are off). The refiner's
    helper LLM is agent.inference.llm_url/llm_model, else the served policy (as the debugger's)."""
    from stages.agent.inference_tools import HelperLLM, LoopAids, Refiner

    tools = agent.inference
    if not (tools.rollback or tools.refiner):
        return lambda prompt, question: None
    refiner = Refiner(HelperLLM.from_config(tools, endpoint.url, endpoint.model), tools.refine_threshold_tokens) \
        if tools.refiner else None
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    return lambda prompt, question: LoopAids(tools, refiner, count, prompt, question)


def loop_settings(cfg: EvalSection, endpoint: EndpointRef) -> LoopSettings:
    return LoopSettings(model=endpoint.model, max_tokens=cfg.max_tokens, max_total_tokens=cfg.max_total_tokens,
                        temperature=cfg.temperature, top_p=cfg.top_p, extras=sampling_extras(cfg, endpoint),
                        max_llm_calls=2 * (cfg.max_python + cfg.max_search) + 8)


async def infer_sample(client: Any, settings: LoopSettings, timeout_s: float, prompt: str, box: Any, item: Any,
                       sample: int, benchmark: str, benchmark_hash: str, failures: list[str],
                       aids: Any = None) -> PredictionRow | None:
    """One sample as a predictions row; None (and a note in `failures`) when the server could not be reached."""
    import openai

    from stages.agent.protocol import count_tool_calls, extract_answer

    state, error, timed_out = SampleState(), None, False
    start = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            await run_sample(client, settings, prompt, box, sample_seed(benchmark, item.id, sample), state, aids)
    except TimeoutError:
        timed_out, state.finish_reason = True, "timeout"
    except (openai.APIConnectionError, openai.InternalServerError, openai.RateLimitError) as err:
        failures.append(f"{item.id}#{sample}: {type(err).__name__}: {err}")
        return None
    except openai.APIStatusError as err:  # a request the server refuses
        if "maximum context length" in err.message:
            state.finish_reason = "length"  # the context is full: the sample ends as if cut by max_tokens
        else:
            error, state.finish_reason = f"{type(err).__name__}: {err.message}", "error"
    timing = {k: round(v, 4) for k, v in state.timing.items()} | {"total_s": round(time.monotonic() - start, 4)}
    infra = [r for r in state.results if getattr(r, "fault", None) == "infra"]
    return PredictionRow(id=item.id, benchmark=benchmark, sample=sample, question=item.question,
                         golds=list(item.golds), task_type=item.task_type, prediction=extract_answer(state.output),
                         output=state.output, finish_reason=state.finish_reason,
                         tool_calls=count_tool_calls(state.output), timing=timing, timed_out=timed_out, error=error,
                         model=settings.model, benchmark_hash=benchmark_hash,
                         completion_tokens=state.completion_tokens, llm_calls=state.llm_calls,
                         inference_tools=dict(state.inference_tools), infra_failures=len(infra),
                         infra_errors=[f"{r.tool}: {r.meta.get('error') or r.text}"[:300] for r in infra[:3]],
                         meta=dict(item.meta))


def load_tokenizer(model: ModelRef) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model.path)
    except OSError as err:
        raise FileNotFoundError(f"cannot load the tokenizer of {model.path} to apply its chat template locally "
                                f"({err}); the model must be a local folder or in the HF cache") from err


async def close_quietly(*things: Any) -> None:
    for thing in things:
        for name in ("aclose", "close"):
            method = getattr(thing, name, None)
            if method is None:
                continue
            try:
                result = method()
                if asyncio.iscoroutine(result):
                    await result
            except Exception as err:  # noqa: BLE001 -- closing must not hide the real outcome
                log.warning("closing %s failed: %s", type(thing).__name__, err)
            break
