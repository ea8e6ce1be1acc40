"""Public SFT formats -> one validated sharegpt shape -> a LLaMA-Factory dataset folder.

Accepted inputs (`.json` list, `.jsonl`, `.parquet`):
- sharegpt (ARPO-SFT-54K): a message list under `conversations` (or `messages`), tags `from`/`value` with
  `human`/`gpt` (OpenAI-style `role`/`content` with `user`/`assistant` also accepted), optional `system` column
  or a leading system message. The whole tool trajectory sits in one assistant turn.
- alpaca (Tool-Star-SFT-54K): `instruction`, optional `input`, `output`, optional `system` and `history`
  ([[query, answer], ...]). The user turn is `instruction + "\\n" + input`, as LLaMA-Factory joins them.

Every row is checked; a bad row raises (or, with bad_rows="skip", is reported) with its file and 0-based index.
Output rows: {"conversations": [{"from": "human"|"gpt"|..., "value": str}, ...], "system": str | None}.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from stages.core.atomic import atomic_path, write_json
from stages.core.errors import BadInputError, MissingInputError
from stages.core.rl_parquet import DatasetRowError

Format = Literal["sharegpt", "alpaca"]
_ROLE_TAGS = {"human": "human", "user": "human", "gpt": "gpt", "assistant": "gpt", "observation": "observation",
              "tool": "observation", "function_call": "function_call", "system": "system"}
_ASKS = ("human", "observation")       # even positions (0, 2, ...)
_ANSWERS = ("gpt", "function_call")    # odd positions (1, 3, ...)
DATA_FILE = "{name}.jsonl"


@dataclass
class ConvertReport:
    """What a conversion kept and what it left out (each skipped row names file and index)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[DatasetRowError] = field(default_factory=list)
    source: str = ""

    @property
    def counts(self) -> dict[str, int]:
        return {"rows": len(self.rows), "skipped": len(self.skipped)}


def read_records(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(0-based index, raw record) for each record of a .json list, .jsonl or .parquet file."""
    path = Path(path)
    if not path.is_file():
        raise MissingInputError(f"SFT data file {path} does not exist; set sft.dataset_path to an existing file")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as err:
            raise BadInputError(f"{path} is not a readable parquet file ({str(err).splitlines()[0]}); convert it "
                                "or name a .json / .jsonl file") from err
        yield from enumerate(table.to_pylist())
    elif suffix == ".jsonl":
        with open(path, encoding="utf-8") as handle:
            index = 0
            for line in handle:
                if not line.strip():
                    continue
                try:
                    yield index, json.loads(line)
                except json.JSONDecodeError as err:
                    yield index, DatasetRowError(path, index, f"not valid JSON ({err.msg}); fix or delete that line")
                index += 1
    elif suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise BadInputError(f"{path}: not valid JSON ({err}); a .json SFT file holds one list of rows "
                                "(a file with one row per line must be named .jsonl)") from err
        if not isinstance(data, list):
            raise DatasetRowError(path, 0, f"a .json SFT file must hold a list of rows, got {type(data).__name__}")
        yield from enumerate(data)
    else:
        raise BadInputError(f"SFT data file {path}: unknown extension {suffix!r}; use .json, .jsonl or .parquet")


def _text(path: Path, index: int, value: Any, what: str, allow_empty: bool = False) -> str:
    if not isinstance(value, str) or (not allow_empty and not value.strip()):
        raise DatasetRowError(path, index, f"{what} must be a non-empty string, got {value!r:.80}")
    return value


def sharegpt_row(path: Path, index: int, raw: Any) -> dict[str, Any]:
    """Validate one sharegpt row and return it in the canonical shape."""
    if not isinstance(raw, dict):
        raise DatasetRowError(path, index, f"row must be an object, got {type(raw).__name__}")
    key = next((k for k in ("conversations", "messages") if k in raw), None)
    if key is None:
        raise DatasetRowError(path, index, f"no 'conversations' or 'messages' list (keys: {sorted(raw)}); "
                                           "is this an alpaca file? set sft.dataset_format=alpaca")
    messages = raw[key]
    if not isinstance(messages, list) or not messages:
        raise DatasetRowError(path, index, f"'{key}' must be a non-empty list of messages, got {messages!r:.80}")
    system = raw.get("system")
    if system is not None:
        system = _text(path, index, system, "'system'", allow_empty=True)
    turns = []
    for j, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DatasetRowError(path, index, f"{key}[{j}] must be an object, got {message!r:.80}")
        tag = message.get("from", message.get("role"))
        value = message.get("value", message.get("content"))
        role = _ROLE_TAGS.get(tag) if isinstance(tag, str) else None
        if role is None:
            raise DatasetRowError(path, index, f"{key}[{j}] has role tag {tag!r}; expected one of "
                                               f"{sorted(_ROLE_TAGS)} under 'from' (or 'role')")
        if role == "system":
            if j != 0:
                raise DatasetRowError(path, index, f"{key}[{j}] is a system message; only the first may be one")
            system = _text(path, index, value, f"{key}[{j}] content", allow_empty=True)
            continue
        turns.append({"from": role, "value": _text(path, index, value, f"{key}[{j}] content")})
    for position, turn in enumerate(turns):
        expected = _ASKS if position % 2 == 0 else _ANSWERS
        if turn["from"] not in expected:
            raise DatasetRowError(path, index, f"turn {position} is {turn['from']!r} but must be one of {expected}: "
                                               "turns alternate user/assistant, starting with the user")
    if len(turns) % 2:
        raise DatasetRowError(path, index, f"{len(turns)} turns: the conversation must end with an assistant turn")
    return {"conversations": turns, "system": system}


def alpaca_row(path: Path, index: int, raw: Any) -> dict[str, Any]:
    """Validate one alpaca row (instruction/input/output) and return it in the canonical sharegpt shape."""
    if not isinstance(raw, dict):
        raise DatasetRowError(path, index, f"row must be an object, got {type(raw).__name__}")
    if "output" not in raw:
        raise DatasetRowError(path, index, f"no 'output' (keys: {sorted(raw)}); is this a sharegpt file? "
                                           "set sft.dataset_format=sharegpt")
    instruction = raw.get("instruction") or ""
    query = raw.get("input") or ""
    for name, value in (("instruction", instruction), ("input", query)):
        if not isinstance(value, str):
            raise DatasetRowError(path, index, f"'{name}' must be a string, got {value!r:.80}")
    prompt = "\n".join(part for part in (instruction, query) if part)
    if not prompt.strip():
        raise DatasetRowError(path, index, "'instruction' and 'input' are both empty: the row has no user turn")
    turns = []
    history = raw.get("history") or []
    if not isinstance(history, list):
        raise DatasetRowError(path, index, f"'history' must be a list of [query, answer] pairs, got {history!r:.80}")
    for j, pair in enumerate(history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise DatasetRowError(path, index, f"history[{j}] must be a [query, answer] pair, got {pair!r:.80}")
        turns += [{"from": "human", "value": _text(path, index, pair[0], f"history[{j}][0]")},
                  {"from": "gpt", "value": _text(path, index, pair[1], f"history[{j}][1]")}]
    turns += [{"from": "human", "value": prompt},
              {"from": "gpt", "value": _text(path, index, raw["output"], "'output'")}]
    system = raw.get("system")
    if system is not None:
        system = _text(path, index, system, "'system'", allow_empty=True)
    return {"conversations": turns, "system": system}


_CONVERTERS = {"sharegpt": sharegpt_row, "alpaca": alpaca_row}


def convert_file(path: str | Path, fmt: Format, bad_rows: Literal["error", "skip"] = "error",
                 max_rows: int | None = None) -> ConvertReport:
    """Read and validate every row of a public SFT file. `bad_rows="error"` raises on the first bad row."""
    if fmt not in _CONVERTERS:
        raise ValueError(f"unknown SFT format {fmt!r}; choose one of {sorted(_CONVERTERS)}")
    path = Path(path)
    report = ConvertReport(source=str(path))
    for index, raw in read_records(path):
        if max_rows is not None and len(report.rows) >= max_rows:
            break
        try:
            if isinstance(raw, DatasetRowError):
                raise raw
            report.rows.append(_CONVERTERS[fmt](path, index, raw))
        except DatasetRowError as err:
            if bad_rows == "error":
                raise
            report.skipped.append(err)
    if not report.rows:
        raise ValueError(f"{path}: no valid {fmt} rows (skipped {len(report.skipped)}); first problem: "
                         f"{report.skipped[0] if report.skipped else 'the file is empty'}")
    return report


def dataset_info(name: str, ranking: bool = False) -> dict[str, Any]:
    """The `dataset_info.json` entry LLaMA-Factory needs for our canonical sharegpt rows."""
    columns = {"messages": "conversations", "system": "system"}
    if ranking:
        columns |= {"chosen": "chosen", "rejected": "rejected"}
    entry: dict[str, Any] = {"file_name": DATA_FILE.format(name=name), "formatting": "sharegpt", "columns": columns}
    if ranking:
        entry["ranking"] = True
    return {name: entry}


def write_lf_dataset(rows: Iterable[dict[str, Any]], folder: str | Path, name: str, ranking: bool = False) -> Path:
    """Write rows (streamed, atomically) plus `dataset_info.json` into `folder`; returns the folder."""
    folder = Path(folder)
    count = 0
    with atomic_path(folder / DATA_FILE.format(name=name)) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    if count == 0:
        raise ValueError(f"no rows to write into the LLaMA-Factory dataset {folder}/{name}")
    write_json(folder / "dataset_info.json", dataset_info(name, ranking))
    return folder
