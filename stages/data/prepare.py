"""The data stage: produce the RL parquet files, the eval JSONL and the search corpus as one DatasetRef.

files roles: rl_train, rl_valid (verl parquet), eval_test (JSONL question/answer, our "synthetic" benchmark),
corpus (FlashRAG JSONL), tasks (every generated task with its reference solution / search hops, for teacher
trajectories and tests).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from stages.core.atomic import write_jsonl
from stages.core.codeversion import code_version
from stages.core.config.data import DataSection
from stages.core.errors import BadInputError
from stages.core.fingerprint import hash_value
from stages.core.input_files import hash_input
from stages.core.log import get_logger
from stages.core.refs import DatasetRef
from stages.core.rl_parquet import DatasetRowError, make_row, read_rl_parquet, write_rl_parquet
from stages.core.templates import load_template
from stages.core.workspace import stage_dir
from stages.data.synthetic import generate

log = get_logger(__name__)


def data_key(cfg: DataSection) -> str:
    """The stage's one key (its folder name and its Prefect cache key): the section, the input files, the prompt."""
    inputs = [hash_input(path, f"data.{key}") for key in ("train_path", "valid_path", "corpus_path")
              if (path := getattr(cfg, key))]
    return hash_value(cfg, inputs, load_template(cfg.system_prompt), code_version(__name__))


def prepare_data(cfg: DataSection, output_root: str | Path, force: bool = False) -> DatasetRef:
    out = stage_dir(output_root, "data", data_key(cfg), force=force)
    files = {"rl_train": "rl_train.parquet", "rl_valid": "rl_valid.parquet"}
    if cfg.source == "synthetic":
        files |= {"eval_test": "eval_test.jsonl", "corpus": "corpus.jsonl", "tasks": "tasks.jsonl"}
    elif cfg.corpus_path:
        files["corpus"] = "corpus.jsonl"
    if not out.complete:
        if cfg.source == "synthetic":
            _write_synthetic(cfg, out.path)
        else:
            _write_from_parquet(cfg, out.path)
        out.finish(counts=_counts(out.path, files))
    paths = {role: str(out.path / name) for role, name in files.items() if (out.path / name).exists()}
    return DatasetRef(path=str(out.path), fingerprint=out.fingerprint, files=paths,
                      meta={"source": cfg.source, **out.marker().get("counts", {})})


def _counts(folder: Path, files: dict[str, str]) -> dict[str, int]:
    """`<role>_rows` of each file written (DatasetRef.meta): what later size checks read without opening files."""
    import pyarrow.parquet as pq

    counts = {}
    for role, name in files.items():
        path = folder / name
        if path.is_file():
            counts[f"{role}_rows"] = pq.read_metadata(path).num_rows if name.endswith(".parquet") else \
                sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    return counts


def _write_synthetic(cfg: DataSection, folder: Path) -> None:
    generated = generate(cfg.synthetic)
    system = load_template(cfg.system_prompt)
    for split, name in (("train", "rl_train.parquet"), ("valid", "rl_valid.parquet")):
        rows = [make_row(i, "synthetic_tir", t.kind, system, t.question, t.answer, split)
                for i, t in enumerate(t for t in generated.tasks if t.split == split)]
        write_rl_parquet(rows, folder / name)
    write_jsonl(folder / "eval_test.jsonl", [{"id": t.id, "question": t.question, "answer": t.answer,
                                              "kind": t.kind} for t in generated.tasks if t.split == "test"])
    write_jsonl(folder / "corpus.jsonl", generated.corpus)
    write_jsonl(folder / "tasks.jsonl", [t.to_json() for t in generated.tasks])
    log.info("generated %d tasks and a corpus of %d documents", len(generated.tasks), len(generated.corpus))


def _write_from_parquet(cfg: DataSection, folder: Path) -> None:
    for path, name in ((cfg.train_path, "rl_train.parquet"), (cfg.valid_path, "rl_valid.parquet")):
        if not path:
            continue
        limit = cfg.max_train_rows if name == "rl_train.parquet" else None
        skipped: list[DatasetRowError] | None = [] if cfg.bad_rows == "skip" else None
        rows = read_rl_parquet(path, fix_backspace_boxed=cfg.fix_backspace_boxed, limit=limit, skipped=skipped)
        for err in skipped or []:
            log.warning("skipping bad row: %s", err)
        if not rows:
            key = "data.train_path" if name == "rl_train.parquet" else "data.valid_path"
            raise BadInputError(f"{key}={path}: no valid rows ({len(skipped or [])} bad rows skipped, each logged "
                                "with its row); fix the rows or point it at another file")
        write_rl_parquet([make_row(r.index, r.data_source, r.ability, r.system, r.question, r.ground_truth,
                                   "train" if "train" in name else "valid") for r in rows], folder / name)
        log.info("validated %d rows of %s", len(rows), path)
    if cfg.corpus_path:
        from stages.agent.search.local import read_corpus

        read_corpus(cfg.corpus_path)  # every line checked (a bad one is named), before it is shipped
        shutil.copyfile(cfg.corpus_path, folder / "corpus.jsonl")
