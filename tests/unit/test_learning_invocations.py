"""The learning bench's invocation log (bench/learning_record.py): every invocation that ran runs, an interrupted one
included, counts toward the design's wall time and pins the design to its commit."""

from __future__ import annotations

import argparse
import json
import signal
from pathlib import Path

import pytest

from bench import learning_record as lr


def _args(**overrides: str) -> argparse.Namespace:
    return argparse.Namespace(**{"split": "eval_test", "tag": "", "families": "arith", **overrides})


def test_an_interrupted_invocation_counts_its_wall_time_and_pins_the_commit(tmp_path: Path) -> None:
    lr.record_invocation(tmp_path, _args(), 600.0, ran=True, commit="aaaaaaa", interrupted=True)
    lr.record_invocation(tmp_path, _args(), 120.0, ran=True, commit="aaaaaaa")
    lr.record_invocation(tmp_path, _args(), 999.0, ran=False, commit="bbbbbbb")  # a report alone: adds nothing

    lines = [json.loads(line) for line in (tmp_path / "invocations.jsonl").read_text().splitlines()]
    assert [line.get("interrupted", False) for line in lines] == [True, False, False]
    assert lr.bench_wall_min(tmp_path, "learning") == 12.0  # (600 + 120) / 60
    assert lr.pinned_commit(tmp_path, _args(), "bbbbbbb") == "aaaaaaa"  # resuming elsewhere is refused
    assert lr.pinned_commit(tmp_path, _args(), "aaaaaaa") is None
    assert lr.invocations(tmp_path, "learning-valid") == []  # another record's log is its own


def test_sigterm_becomes_an_interrupt_the_bench_records() -> None:
    from bench.bench_learning import _interrupt

    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        _interrupt(signal.SIGTERM, None)
