"""verl 0.9.1's own FSDP checkpoint (FSDPCheckpointManager, 2 gloo ranks, FSDP2 on CPU) merges back exactly, and the
committed fixture tests/fixtures/verl_fsdp_0.9.1 (used by the main suite's merge-stage test) has verl's layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stages.core.env import PROJECT_ROOT
from stages.rl.fsdp_merge import merge_fsdp_shards
from tests.verl.fsdp_fixture import write_fixture

pytestmark = pytest.mark.verl
FIXTURE = PROJECT_ROOT / "tests" / "fixtures" / "verl_fsdp_0.9.1"


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    return write_fixture(tmp_path_factory.mktemp("verl_ckpt"))


def test_committed_fixture_has_the_layout_verl_writes(fresh):
    assert _files(fresh) == _files(FIXTURE)
    actor = "global_step_1/actor"
    assert json.loads((fresh / actor / "fsdp_config.json").read_text()) == \
        json.loads((FIXTURE / actor / "fsdp_config.json").read_text()) == {"FSDP_version": 2, "world_size": 2}
    ours, theirs = (torch.load(r / actor / "model_world_size_2_rank_0.pt", weights_only=False) for r in (fresh, FIXTURE))
    assert list(ours) == list(theirs)
    assert all(type(ours[k]) is type(theirs[k]) and ours[k].placements == theirs[k].placements for k in ours)


def test_verl_shards_merge_back_exactly_and_agree_with_verls_own_merger(fresh, tmp_path):
    original = load_file(str(fresh / "original" / "model.safetensors"))
    merged = load_file(str(merge_fsdp_shards(fresh / "global_step_1" / "actor", tmp_path / "ours") /
                           "model.safetensors"))
    assert set(merged) == set(original) and all(torch.equal(merged[k], original[k]) for k in original)
    proc = subprocess.run([sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir",
                           str(fresh / "global_step_1" / "actor"), "--target_dir", str(tmp_path / "verl")],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = {}
    for file in (tmp_path / "verl").glob("*.safetensors"):
        theirs |= load_file(str(file))
    assert set(theirs) == set(merged)  # verl's merger writes bfloat16: ours, rounded, is the same tensor
    assert all(torch.equal(theirs[k], merged[k].to(theirs[k].dtype)) for k in merged)
