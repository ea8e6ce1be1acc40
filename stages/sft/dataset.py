"""The SFT dataset folder of one run: teacher trajectories or a converted public file, in LLaMA-Factory form."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stages.core.atomic import write_json
from stages.core.config.agent import AgentSection
from stages.core.config.sft import SFTSection
from stages.core.log import get_logger
from stages.core.refs import DatasetRef
from stages.sft.formats import convert_file, write_lf_dataset
from stages.sft.teacher import TeacherReport, build_trajectories, corpus_docs, teacher_toolbox, train_tasks

log = get_logger(__name__)

DATASET_NAME = "arpo_sft"
COUNTS_FILE = "counts.json"


def prepare_sft_dataset(cfg: SFTSection, agent: AgentSection, data: DatasetRef | None, folder: Path,
                        cache_root: str | Path) -> dict[str, Any]:
    """Write `folder/{dataset_info.json, arpo_sft.jsonl, counts.json}` unless a finished copy is there."""
    counts_path = folder / COUNTS_FILE
    if counts_path.is_file() and (folder / "dataset_info.json").is_file():
        return json.loads(counts_path.read_text())
    if cfg.dataset == "file":
        report = convert_file(cfg.dataset_path or "", cfg.dataset_format, cfg.bad_rows, cfg.max_samples)
        for err in report.skipped[:20]:
            log.warning("skipping bad SFT row: %s", err)
        if len(report.skipped) > 20:
            log.warning("... and %d more bad rows", len(report.skipped) - 20)
        rows, counts = report.rows, {"source": report.source, **report.counts}
    else:
        rows, counts = teacher_rows(cfg, agent, data, cache_root)
    write_lf_dataset(rows, folder, DATASET_NAME)
    write_json(counts_path, counts)
    log.info("SFT dataset: %s", counts)
    return counts


def teacher_report(tasks: list[dict[str, Any]], agent: AgentSection, data: DatasetRef, cache_root: str | Path,
                   limit: int, seed: int) -> TeacherReport:
    """Teacher trajectories for `tasks` with the real toolbox over the corpus RL and evaluation search."""
    corpus = agent.search.corpus_path or data.file("corpus")
    with teacher_toolbox(agent, corpus, cache_root) as tools:
        return build_trajectories(tasks, tools, corpus_docs(corpus), agent.prompt_template, limit, seed=seed)


def teacher_rows(cfg: SFTSection, agent: AgentSection, data: DatasetRef | None,
                 cache_root: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    if data is None:
        raise ValueError("sft.dataset=teacher needs the data stage's DatasetRef (files 'tasks' and 'corpus'); "
                         "run the data stage with data.source=synthetic, or set sft.dataset=file")
    tasks = train_tasks(data.file("tasks"))
    report = teacher_report(tasks, agent, data, cache_root, cfg.n_trajectories, cfg.teacher_seed)
    if not report.rows:
        raise ValueError(f"no teacher trajectory could be built from {len(tasks)} train tasks; first problem: "
                         f"{report.dropped[0] if report.dropped else 'no train tasks'}")
    if len(report.rows) < cfg.n_trajectories:
        log.warning("teacher: built %d of the %d trajectories asked for (sft.n_trajectories); the train split "
                    "has %d tasks", len(report.rows), cfg.n_trajectories, len(tasks))
    return report.rows, {"source": "teacher", **report.counts}
