"""A Prefect cache hit serves only what is still there (real data stage, real Prefect API and result store): a
truncated, vanished or (with verify) silently changed output is recomputed with a warning naming the file, never
handed on; an intact one stays `Cached` with the same fingerprint."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from prefect import flow

from stages.core.config.loader import load_config
from stages.core.refs import Ref
from stages.core.selection import select_stages
from stages.core.workspace import stage_dir
from tasks.stage_tasks import entry_task, forced, run_stage, stage_task

pytestmark = pytest.mark.integration
BIG = 2 << 20  # above manifest.CHEAP_BYTES: a quick check only looks at its size and time


@pytest.fixture(autouse=True)
def _prefect(prefect_harness):
    yield


@flow
def data_flow(seed: int, root: str, verify: bool = False) -> tuple[str, Ref]:
    cfg = load_config("tiny-cpu", [f"data.synthetic.seed={seed}"])
    state = run_stage(entry_task("data"), select_stages(), cfg.data, root, return_state=True)
    return state.name, state.result()


def test_damaged_or_vanished_output_is_recomputed_with_a_warning(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    root = str(tmp_path)
    state, first = data_flow(201, root)
    assert state == "Completed"
    assert data_flow(201, root) == ("Cached", first)
    train = Path(first.files["rl_train"])
    size = train.stat().st_size
    with open(train, "r+b") as handle:      # damaged after it was written (a full disk, a bad copy, a hand edit)
        handle.truncate(100)
    with caplog.at_level(logging.WARNING, logger="arpo"):
        state, rebuilt = data_flow(201, root)
    assert state == "Completed" and rebuilt.fingerprint != first.fingerprint    # recomputed: downstream follows
    assert train.stat().st_size == size                                         # and whole again
    assert (f"cached output of stage data is damaged, recomputing it: rl_train.parquet: is 100 bytes, {size:,} when "
            "the stage wrote it (truncated or replaced)") in caplog.text
    assert data_flow(201, root) == ("Cached", rebuilt)                           # a good entry again
    caplog.clear()
    folder = Path(rebuilt.path)
    for file in folder.iterdir():
        file.unlink()
    folder.rmdir()                                                              # the whole folder deleted
    with caplog.at_level(logging.WARNING, logger="arpo"):
        state, again = data_flow(201, root)
    assert state == "Completed" and Path(again.files["rl_train"]).is_file()
    assert f"cached output of stage data is gone ({folder}); recomputing it" in caplog.text


@stage_task("weights-probe", lambda name: name, off_table=True)
def weights_task(name: str, output_root: str) -> Ref:
    """A stage shaped like merge: a large weights file handed on by path."""
    out = stage_dir(output_root, "weights-probe", name, force=forced())
    if not out.complete:
        (out.path / "model.safetensors").write_bytes(os.urandom(BIG))
        out.finish()
    return Ref(path=str(out.path), fingerprint=out.fingerprint)


@flow
def weights_flow(root: str, verify: bool = False) -> tuple[str, Ref]:
    state = weights_task("w", root, return_state=True)
    return state.name, state.result()


def test_same_size_change_of_a_large_file_is_caught_by_verify(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = str(tmp_path)
    _, first = weights_flow(root)
    weights = Path(first.path) / "model.safetensors"
    stat = weights.stat()
    with open(weights, "r+b") as handle:     # bit rot: one byte, same size, same modification time
        handle.seek(BIG // 2)
        byte = handle.read(1)
        handle.seek(BIG // 2)
        handle.write(bytes([byte[0] ^ 0xFF]))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights_flow(root) == ("Cached", first)      # the per-hit check: sizes and times only, for large files
    with caplog.at_level(logging.WARNING, logger="arpo"):
        state, rebuilt = weights_flow(root, verify=True)   # `arpo run --verify`
    assert state == "Completed" and rebuilt.fingerprint != first.fingerprint
    assert ("cached output of stage weights-probe is damaged, recomputing it: model.safetensors: content changed "
            "since the stage wrote it (same size, different sha256)") in caplog.text
