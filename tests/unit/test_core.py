"""Registry, fingerprints, atomic writes and stage folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages.core.atomic import atomic_path, read_jsonl, write_json
from stages.core.fingerprint import hash_path, hash_value, stable_json
from stages.core.registry import Registry, UnknownNameError
from stages.core.workspace import stage_dir


def test_registry_miss_lists_known_names_and_nearest() -> None:
    losses: Registry = Registry("policy loss")

    @losses.register("ppo_dual_clip")
    def dual_clip() -> str:
        return "x"

    assert losses.get("ppo_dual_clip") is dual_clip
    with pytest.raises(UnknownNameError, match=r"unknown policy loss 'ppo_dual'.*'ppo_dual_clip'"
                       r".*Known: \['ppo_dual_clip'\]"):
        losses.get("ppo_dual")


def test_registry_refuses_a_second_function_under_a_taken_name() -> None:
    reg: Registry = Registry("reward")
    reg.register("a")(lambda: 1)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(print)


def test_stable_json_is_order_independent() -> None:
    assert stable_json({"b": 1, "a": [1, {"d": 2, "c": 3}]}) == '{"a":[1,{"c":3,"d":2}],"b":1}'
    assert hash_value({"a": 1, "b": 2}) == hash_value({"b": 2, "a": 1})


def test_hash_path_tracks_content_and_names(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("one")
    first = hash_path(tmp_path)
    (tmp_path / "a.txt").write_text("two")
    second = hash_path(tmp_path)
    (tmp_path / "a.txt").rename(tmp_path / "b.txt")
    third = hash_path(tmp_path)
    assert len({first, second, third}) == 3
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hash_path(tmp_path / "missing")


def test_atomic_path_leaves_old_content_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    write_json(target, {"v": 1})
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text('{"v": 2')  # half-written
            raise RuntimeError("crash mid-write")
    assert json.loads(target.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_atomic_path_replaces_directories(tmp_path: Path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "old").write_text("x")
    with atomic_path(target) as tmp:
        tmp.mkdir()
        (tmp / "new").write_text("y")
    assert [p.name for p in target.iterdir()] == ["new"]


def test_read_jsonl_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(ValueError, match=r"rows.jsonl:2: not valid JSON"):
        read_jsonl(path)


def test_stage_dir_marker_and_force(tmp_path: Path) -> None:
    out = stage_dir(tmp_path, "sft", "k1")
    assert not out.complete
    (out.path / "w.bin").write_bytes(b"abc")
    fingerprint = out.finish(step=3)
    assert out.complete and out.fingerprint == fingerprint and out.marker()["step"] == 3
    again = stage_dir(tmp_path, "sft", "k1")
    assert again.complete and again.fingerprint == fingerprint   # resumed, not rebuilt
    forced = stage_dir(tmp_path, "sft", "k1", force=True)
    assert not forced.complete and not (forced.path / "w.bin").exists()
    (forced.path / "w.bin").write_bytes(b"abc")
    # same content, new build id: a rebuild always yields a new fingerprint so downstream recomputes
    assert forced.finish() != fingerprint
