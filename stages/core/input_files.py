"""Files a user points at, checked before any work, each problem one input error naming the key, the file and the fix.

A config field that names an input says what it holds: `json_schema_extra=input_file("parquet", columns=(...))`
(merged with `used_when` where the field also belongs to a mode). `check_inputs(cfg, stages)`
(stages.core.input_check) walks the resolved config and checks every such field that is set, in the sections the
planned stages read: the file exists and is readable, and it has the format the field says (a parquet footer with
the required columns and at least one row, a JSON object on the first line of a JSONL file, a model folder with
config.json, a known template). It reads only
what that takes (a parquet footer, one line), so a cached rerun pays milliseconds; the stage that reads every row
checks the rows and names the row (the data stage runs first in the pipeline).

`hash_input(path, key)` is the fingerprint a stage key takes of such a file: a missing or unreadable file is the
same input error, not a FileNotFoundError raised while Prefect computes a cache key.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stages.core.atomic import iter_json_objects
from stages.core.env import PROJECT_ROOT
from stages.core.errors import BadInputError, MissingInputError
from stages.core.fingerprint import hash_path


def input_file(kind: str, *, columns: tuple[str, ...] = (), when: dict[str, Any] | None = None,
               project_relative: bool = False) -> dict[str, Any]:
    """`json_schema_extra` of a field naming an input. kind: file | parquet | records (.json/.jsonl/.parquet by
    suffix) | jsonl | json_object | model_dir | template | executable. `when`: sibling values under which the field
    is an input (e.g. model.path is a folder only for source=local); `project_relative`: a relative path is under
    the project root (configs/deepspeed/...), else under the working directory."""
    spec = {"kind": kind, "columns": list(columns), "when": when or {}, "project_relative": project_relative}
    return {"input": spec}


def check_input(key: str, value: Any, spec: dict[str, Any]) -> None:
    kind = spec["kind"]
    if kind == "template":
        from stages.core.templates import load_template

        load_template(str(value))
        return
    path = resolve(str(value), spec.get("project_relative", False))
    if kind == "model_dir":
        if not (path / "config.json").is_file():
            raise MissingInputError(f"{key}={value}: {path} is not a Hugging Face model folder (no config.json); "
                                    "point it at a folder saved with save_pretrained")
        return
    _readable_file(key, value, path)
    CHECKS[kind](key, path, spec)


def resolve(value: str, project_relative: bool = False) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() or not project_relative else (PROJECT_ROOT / path).resolve()


def _readable_file(key: str, value: Any, path: Path) -> None:
    if not path.exists():
        raise MissingInputError(f"{key}={value}: {path.resolve()} does not exist; fix the path (relative paths are "
                                f"taken from {os.getcwd()})")
    if not path.is_file():
        raise BadInputError(f"{key}={value}: {path} is a folder, not a file; name the file inside it")
    try:
        with open(path, "rb") as handle:
            handle.read(1)
    except OSError as err:
        raise BadInputError(f"{key}={value}: cannot read {path} ({err.strerror}); fix its permissions") from err


def _parquet(key: str, path: Path, spec: dict[str, Any]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.read_metadata(path)
        names = pq.read_schema(path).names
    except (pa.ArrowException, OSError) as err:
        raise BadInputError(f"{key}: {path} is not a readable parquet file ({str(err).splitlines()[0]}); convert it "
                            "to parquet (e.g. pandas.read_csv(...).to_parquet(...)) or fix the path") from err
    missing = [c for c in spec.get("columns", []) if c not in names]
    if missing:
        raise BadInputError(f"{key}: {path} lacks the column(s) {missing} (it has {names}); expected the verl RL "
                            "schema: data_source, prompt [{role, content}], ability, reward_model {ground_truth}, "
                            "extra_info")
    if meta.num_rows == 0:
        raise BadInputError(f"{key}: {path} has no rows; point {key} at a file with data")


def _first_json_line(key: str, path: Path, spec: dict[str, Any]) -> None:
    for _ in iter_json_objects(path, key, errors="replace"):
        return
    raise BadInputError(f"{key}: {path} is empty; point {key} at a file with data")


def _json_opening(key: str, path: Path, opening: str, what: str) -> None:
    with open(path, encoding="utf-8", errors="replace") as handle:
        head = handle.read(4096).lstrip()
    if not head.startswith(opening):
        raise BadInputError(f"{key}: {path} must hold {what}; it starts with {head[:40]!r}")


def _records(key: str, path: Path, spec: dict[str, Any]) -> None:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        _parquet(key, path, spec)
    elif suffix == ".jsonl":
        _first_json_line(key, path, spec)
    elif suffix == ".json":
        _json_opening(key, path, "[", "a JSON list of rows")
    else:
        raise BadInputError(f"{key}: {path} has the extension {suffix!r}; use a .json, .jsonl or .parquet file")


def _executable(key: str, path: Path, spec: dict[str, Any]) -> None:
    if not os.access(path, os.X_OK):
        raise BadInputError(f"{key}: {path} is not executable; point it at a python interpreter")


CHECKS: dict[str, Callable[[str, Path, dict[str, Any]], None]] = {
    "file": lambda key, path, spec: None,
    "parquet": _parquet,
    "records": _records,
    "jsonl": _first_json_line,
    "json_object": lambda key, path, spec: _json_opening(key, path, "{", "one JSON object"),
    "executable": _executable,
}


def hash_input(value: str, key: str, project_relative: bool = False) -> str:
    """Content fingerprint of the input file `value` (config key `key`), for a stage key."""
    path = resolve(value, project_relative)
    try:
        return hash_path(path)
    except FileNotFoundError as err:
        raise MissingInputError(f"{key}={value}: {path.resolve()} does not exist; fix the path (relative paths are "
                                f"taken from {os.getcwd()})") from err
    except OSError as err:
        raise BadInputError(f"{key}={value}: cannot read {path} ({err.strerror or err}); fix its permissions") from err


def table_rows(data: Any, role: str) -> int:
    """Rows of the data stage's parquet `role` (rl_train, rl_valid): from its ref's counts, else the file footer."""
    counted = data.meta.get(f"{role}_rows")
    if counted is not None:
        return int(counted)
    import pyarrow.parquet as pq

    return pq.read_metadata(data.file(role)).num_rows


def check_rl_rows(rl: Any, data: Any) -> None:
    """The RL train set holds at least one batch (rl.trainer.train_batch_size prompts): checked as soon as the data
    stage is done, and again where RL starts, not after SFT or deep in the trainer."""
    if not rl.enabled:
        return
    rows, batch = table_rows(data, "rl_train"), rl.trainer.train_batch_size
    if rows < batch:
        raise BadInputError(f"the RL train set ({data.file('rl_train')}) has {rows} valid rows, fewer than "
                            f"rl.trainer.train_batch_size={batch} prompts per step; lower rl.trainer.train_batch_size "
                            "or give more data (data.train_path, data.max_train_rows, data.synthetic.*)")
