"""The learning bench's invocation log (bench/learning_record.py): every invocation that ran runs, an interrupted one
included, counts toward the design's wall time and pins the design to its commit."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
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


def test_the_worker_hands_its_process_to_the_evaluation() -> None:
    """RL's worker execs into its `--eval-only` self: same pid (the pool's wait4 and terminate reach both halves),
    its own arguments kept, and what it had printed flushed first. `--help` stands in for a job here."""
    root = Path(__file__).resolve().parents[2]
    script = ("import os, sys; sys.argv = ['bench_learning.py', '--help']; "
              "from bench.bench_learning import hand_over_to_evaluation; "
              "print('pid', os.getpid(), end=' '); hand_over_to_evaluation(); print('not reached')")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=root, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(root)})
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    assert out.startswith(f"pid {proc.pid} ")  # printed before the exec, by the pid that then ran --help
    assert "usage:" in out and "not reached" not in out


def test_a_later_run_of_one_family_keeps_the_other_familys_conditions() -> None:
    arith = {"seeds": ["0", "1", "2", "3", "4"], "overrides": []}
    first = lr.merged_conditions({}, ["arith"], arith, "p.json")
    assert first["families"] == ["arith"] and first["seeds"] == arith["seeds"] and first["by_family"] == {"arith": arith}
    chain = {"seeds": ["0"], "overrides": ["rl.optim.lr=1e-5"]}
    second = lr.merged_conditions(first, ["chain"], chain, "p.json")
    assert second["families"] == ["arith", "chain"] and second["seeds"] == ["0"]  # the top level: this invocation
    assert second["by_family"] == {"arith": arith, "chain": chain}
    # a record written before `by_family` existed: its top level was its one invocation's, for all its families
    legacy = {"families": ["arith"], "seeds": ["0", "1"], "per_question": "p.json"}
    assert lr.merged_conditions(legacy, ["chain"], chain, "p.json")["by_family"]["arith"] == {"seeds": ["0", "1"]}
