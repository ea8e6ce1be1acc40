"""A finished stage folder is checked before it is reused (its manifest: sizes, contents), and one builder at a time
holds it (a flock the kernel drops when its holder dies)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from stages.core import locks, manifest
from stages.core.env import PROJECT_ROOT
from stages.core.workspace import MARKER, stage_dir, verify

BIG = manifest.CHEAP_BYTES + 1  # just above what a quick check hashes on every hit


def finished(tmp_path: Path) -> Path:
    out = stage_dir(tmp_path, "merge", "k")
    (out.path / "model").mkdir()
    (out.path / "model" / "model.safetensors").write_bytes(b"w" * BIG)
    (out.path / "model" / "config.json").write_text('{"n": 1}')
    out.finish(content=out.path / "model")
    return out.path


def test_finish_writes_a_manifest_of_every_file(tmp_path: Path) -> None:
    folder = finished(tmp_path)
    files = json.loads((folder / manifest.MANIFEST).read_text())["files"]
    assert sorted(files) == ["model/config.json", "model/model.safetensors"]      # not the marker, not itself
    assert files["model/model.safetensors"]["size"] == BIG and len(files["model/config.json"]["sha256"]) == 64
    assert verify(folder) == [] and verify(folder, full=True) == []
    assert str(tmp_path / ".locks" / "merge" / "k.lock") not in locks.held()   # finish let go of the folder


def test_truncated_vanished_and_changed_files_are_named(tmp_path: Path) -> None:
    folder = finished(tmp_path)
    weights = folder / "model" / "model.safetensors"
    with open(weights, "r+b") as handle:
        handle.truncate(1024)
    (folder / "model" / "config.json").unlink()
    assert verify(folder) == [
        "model/config.json: vanished",
        f"model/model.safetensors: is 1,024 bytes, {BIG:,} when the stage wrote it (truncated or replaced)"]


def test_a_same_size_change_is_caught_in_small_files_always_and_in_large_ones_by_time_or_full(tmp_path: Path) -> None:
    folder = finished(tmp_path)
    config, weights = folder / "model" / "config.json", folder / "model" / "model.safetensors"
    config.write_text('{"n": 2}')          # same size, small file: hashed on every hit
    changed = "content changed since the stage wrote it (same size, different sha256)"
    assert verify(folder) == [f"model/config.json: {changed}"]
    config.write_text('{"n": 1}')
    stat = weights.stat()
    with open(weights, "r+b") as handle:   # one byte flipped in place, modification time put back
        handle.seek(10)
        handle.write(b"x")
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert verify(folder) == []            # quick: a large file with its size and time unchanged is not hashed
    assert verify(folder, full=True) == [f"model/model.safetensors: {changed}"]   # arpo run --verify
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert verify(folder) == [f"model/model.safetensors: {changed}"]   # a moved time: hashed, caught


def test_a_touched_file_with_the_same_content_is_hashed_once(tmp_path: Path) -> None:
    folder = finished(tmp_path)
    weights = folder / "model" / "model.safetensors"
    os.utime(weights, ns=(0, 123_000_000_000))        # copied without -p, touched
    assert verify(folder) == []
    assert json.loads((folder / manifest.MANIFEST).read_text())["files"]["model/model.safetensors"]["mtime_ns"] == \
        123_000_000_000   # recorded: the next hit does not hash it again


def test_stage_dir_wipes_a_damaged_folder_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = finished(tmp_path)
    with open(folder / "model" / "model.safetensors", "r+b") as handle:
        handle.truncate(10)
    with caplog.at_level(logging.WARNING, logger="arpo"):
        again = stage_dir(tmp_path, "merge", "k")
    assert not again.complete and list(again.path.iterdir()) == []     # rebuilt from scratch, never handed on
    assert "cached output of stage merge is damaged, recomputing it: model/model.safetensors: is 10 bytes" in \
        caplog.text
    assert str(tmp_path / ".locks" / "merge" / "k.lock") in locks.held()   # held while the stage rebuilds
    locks.release(again.path)


def test_a_folder_from_before_manifests_is_reused(tmp_path: Path) -> None:
    folder = finished(tmp_path)
    (folder / manifest.MANIFEST).unlink()
    assert verify(folder) == [] and stage_dir(tmp_path, "merge", "k").complete
    (folder / manifest.MANIFEST).write_text("{not json")
    assert verify(folder) == ["_MANIFEST.json is unreadable"]


HOLDER = """
import sys
from stages.core import locks
locks.acquire(sys.argv[1])
print("held", flush=True)
sys.stdin.readline()
"""


def test_one_builder_at_a_time_and_a_killed_holder_frees_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "bootstrap" / "k"
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=PROJECT_ROOT,
                             env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    got, done = threading.Event(), threading.Event()

    def build() -> None:
        locks.acquire(folder)
        got.set()
        done.wait(30.0)
        locks.release(folder)

    waiter = threading.Thread(target=build, daemon=True)
    try:
        assert child.stdout.readline().strip() == "held"
        waiter.start()
        assert not got.wait(1.0)          # another process builds it: this one waits
        child.kill()                      # kill -9: the kernel drops its flock, no stale lock
        child.wait()
        assert got.wait(30.0)
        holder = (tmp_path / ".locks" / "bootstrap" / "k.lock").read_text().strip()
        assert holder == str(os.getpid())   # who holds it, for the "waiting for another run (pid ...)" line
    finally:
        child.kill()
        done.set()
        waiter.join(5.0)
    assert str(tmp_path / ".locks" / "bootstrap" / "k.lock") not in locks.held()


def test_threads_of_one_process_take_turns_and_a_thread_may_retake_its_own(tmp_path: Path) -> None:
    folder = tmp_path / "infer" / "k"
    locks.acquire(folder)
    locks.acquire(folder)                 # the same thread again (a retry): no wait for itself
    other = threading.Event()
    thread = threading.Thread(target=lambda: (locks.acquire(folder), other.set(), locks.release(folder)),
                              daemon=True)
    thread.start()
    assert not other.wait(0.5)            # another thread waits
    locks.release(folder)
    assert other.wait(10.0)
    thread.join(5.0)
    assert str(locks.lock_path(folder)) not in locks.held()


def test_marker_is_written_after_the_manifest(tmp_path: Path) -> None:
    folder = finished(tmp_path)
    assert (folder / manifest.MANIFEST).stat().st_mtime_ns <= (folder / MARKER).stat().st_mtime_ns
