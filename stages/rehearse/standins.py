"""Stand-in inputs a rehearsal writes when a profile's file is not on this machine and nothing else can stand in.

The SFT file (e.g. ARPO-SFT-54K) when the RL data is a real parquet: the scripted teacher needs the synthetic task
set, so the rehearsal writes a small file in the profile's SFT format from the parquet's own rows (its system
prompt, question and ground truth; the target a minimal protocol answer with a thinking block). Its schema is the
format's, its content trivial: it exercises reading, templating and training, never what the real file holds.
"""

from __future__ import annotations

import json
from pathlib import Path

from stages.agent.protocol import minimal_answer as standin_target
from stages.core.atomic import write_text
from stages.core.rl_parquet import read_rl_parquet


def write_sft_standin(train_parquet: str | Path, out: str | Path, rows: int, fmt: str = "sharegpt") -> Path:
    """`rows` SFT rows in `fmt` (sharegpt | alpaca) from the first rows of the RL parquet."""
    records = []
    skipped: list = []  # bad rows are the data stage's business (data.bad_rows); the first good ones serve here
    for row in read_rl_parquet(str(train_parquet), limit=rows + 64, skipped=skipped)[:rows]:
        target = standin_target(row.ground_truth)
        if fmt == "alpaca":
            records.append({"instruction": row.question, "input": "", "output": target, "system": row.system})
        else:
            records.append({"system": row.system, "conversations": [{"from": "human", "value": row.question},
                                                                    {"from": "gpt", "value": target}]})
    out = Path(out)
    write_text(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return out
