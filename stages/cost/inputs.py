"""The data sizes a plan needs, read without running any stage: training prompts and evaluation questions."""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path

from stages.core.config.loader import RunConfig
from stages.core.log import get_logger

log = get_logger(__name__)


def train_rows(cfg: RunConfig) -> int | None:
    """Rows of the RL train split: generated (synthetic: the generator's own split) or the parquet's row count
    (capped by data.max_train_rows; rows the data stage would skip as bad still count). None: file missing."""
    data = cfg.data
    if data.source == "synthetic":
        return _synthetic_splits(data.synthetic.model_dump_json()).get("train", 0)
    path = Path(data.train_path or "")
    if not path.is_file():
        log.warning("plan: %s does not exist; the number of steps is unknown without rl.trainer.total_steps", path)
        return None
    import pyarrow.parquet as pq

    rows = pq.ParquetFile(path).metadata.num_rows
    return min(rows, data.max_train_rows) if data.max_train_rows else rows


def eval_questions(cfg: RunConfig) -> dict[str, int | None]:
    """Questions per configured benchmark after eval.max_questions (None: its file is not on this machine; the
    hub copy is not fetched for a plan)."""
    from stages.eval.benchmarks import load_benchmark, local_file

    out: dict[str, int | None] = {}
    for name in cfg.eval.benchmarks if cfg.eval.enabled else []:
        if name == "synthetic":
            out[name] = _synthetic_test(cfg)
            continue
        if local_file(name, cfg.eval.data_root) is None:
            out[name] = None
            continue
        try:
            out[name] = len(load_benchmark(name, cfg.eval.data_root, cap=cfg.eval.max_questions).items)
        except (OSError, ValueError) as err:
            log.warning("plan: benchmark %s cannot be read here (%s)", name, err)
            out[name] = None
    return out


@functools.lru_cache(maxsize=4)
def _synthetic_splits(section_json: str) -> dict[str, int]:
    """Tasks per split of the synthetic world `data.synthetic` (as JSON) makes: generated once per plan, for the
    train rows and the test questions alike."""
    from stages.core.config.data import SyntheticSection
    from stages.data.synthetic import generate

    return dict(Counter(task.split for task in generate(SyntheticSection.model_validate_json(section_json)).tasks))


def _synthetic_test(cfg: RunConfig) -> int | None:
    if cfg.data.source != "synthetic":
        return None
    count = _synthetic_splits(cfg.data.synthetic.model_dump_json()).get("test", 0)
    return min(count, cfg.eval.max_questions) if cfg.eval.max_questions else count
