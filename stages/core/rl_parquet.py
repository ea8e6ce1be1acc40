"""The verl / ARPO RL parquet schema: write ours, read and validate theirs.

Columns: data_source (str), prompt (list of {role, content}: system + user), ability (math | qa | ...),
reward_model {ground_truth, style}, extra_info {index, question, split, need_tools_kwargs}, metadata (null).
A malformed row raises DatasetRowError naming the file and the 0-based row.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from stages.core.errors import BadInputError, MissingInputError

BACKSPACE_BOXED = "\x08oxed"  # the reference data has "\b" where "\\b" was meant


class DatasetRowError(BadInputError):
    def __init__(self, path: str | Path, row: int, problem: str) -> None:
        super().__init__(f"{path} row {row}: {problem}")
        self.path, self.row, self.problem = str(path), row, problem


@dataclass(frozen=True)
class RLRow:
    index: int
    data_source: str
    ability: str
    prompt: tuple[tuple[str, str], ...]  # (role, content) pairs
    ground_truth: str
    question: str

    @property
    def system(self) -> str:
        return next((c for r, c in self.prompt if r == "system"), "")

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.prompt]


SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
    ("extra_info", pa.struct([("index", pa.int64()), ("need_tools_kwargs", pa.bool_()),
                              ("question", pa.string()), ("split", pa.string())])),
    ("metadata", pa.null()),
])


def make_row(index: int, data_source: str, ability: str, system: str, question: str, ground_truth: str,
             split: str) -> dict[str, Any]:
    return {"data_source": data_source,
            "prompt": [{"content": system, "role": "system"}, {"content": question, "role": "user"}],
            "ability": ability, "reward_model": {"ground_truth": ground_truth, "style": "rule"},
            "extra_info": {"index": index, "need_tools_kwargs": True, "question": question, "split": split},
            "metadata": None}


def write_rl_parquet(rows: list[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), tmp)
    tmp.replace(path)
    return path


def read_rl_parquet(path: str | Path, fix_backspace_boxed: bool = True, limit: int | None = None,
                    skipped: list[DatasetRowError] | None = None) -> list[RLRow]:
    """Read and validate every row. Without `skipped` a bad row raises; with it, bad rows are collected there
    (each names file and row) and left out."""
    path = Path(path)
    if not path.is_file():
        raise MissingInputError(f"RL parquet {path} does not exist; set data.train_path / data.valid_path")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise BadInputError(f"{path} is not a readable parquet file ({str(err).splitlines()[0]}); convert it to "
                            "parquet in the verl RL schema or fix data.train_path / data.valid_path") from err
    missing = {"prompt", "reward_model"} - set(table.column_names)
    if missing:
        raise DatasetRowError(path, 0, f"missing columns {sorted(missing)} (has {table.column_names}); "
                                       "expected the verl RL schema")
    rows = []
    for i, raw in enumerate(table.to_pylist()):
        if limit is not None and len(rows) >= limit:
            break
        try:
            rows.append(_validate(path, i, raw, fix_backspace_boxed))
        except DatasetRowError as err:
            if skipped is None:
                raise
            skipped.append(err)
    return rows


def _validate(path: Path, i: int, raw: dict[str, Any], fix: bool) -> RLRow:
    prompt = raw.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        raise DatasetRowError(path, i, f"'prompt' must be a non-empty list of {{role, content}}, got {prompt!r:.80}")
    pairs = []
    for j, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str) \
                or message.get("role") not in ("system", "user", "assistant"):
            raise DatasetRowError(path, i, f"prompt[{j}] must be {{role: system|user|assistant, content: str}}, "
                                           f"got {message!r:.80}")
        content = message["content"].replace(BACKSPACE_BOXED, "\\boxed") if fix else message["content"]
        pairs.append((message["role"], content))
    if not any(role == "user" for role, _ in pairs):
        raise DatasetRowError(path, i, "prompt has no user message")
    reward = raw.get("reward_model") or {}
    truth = reward.get("ground_truth") if isinstance(reward, dict) else None
    if isinstance(truth, (list, tuple)):
        truth = str(list(truth))
    if not isinstance(truth, str) or not truth.strip():
        raise DatasetRowError(path, i, f"reward_model.ground_truth must be a non-empty string, got {truth!r:.80}")
    extra = raw.get("extra_info") or {}
    question = extra.get("question") or next(c for r, c in pairs if r == "user")
    return RLRow(index=int(extra.get("index", i) if extra.get("index") is not None else i),
                 data_source=str(raw.get("data_source") or ""), ability=str(raw.get("ability") or ""),
                 prompt=tuple(pairs), ground_truth=truth, question=question)
