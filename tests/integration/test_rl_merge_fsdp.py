"""verl FSDP shard merge: shards written by 2 real gloo ranks as DTensors (Shard(0), Shard(1), Replicate) are
reassembled into an HF folder whose weights equal the original exactly, streamed into several safetensors shards
equal to the in-memory reference assembly; the merge stage on a checkpoint of the pinned verl's own
(stages/core/engine_spec.py VERL_VERSION), and after a crash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stages.core.env import PROJECT_ROOT
from stages.rl.fsdp_merge import find_shards, merge_fsdp_shards

pytestmark = pytest.mark.integration
torch.set_num_threads(1)


def _write_rank_shard(rank: int, world: int, model_dir: str, actor_dir: str, init_file: str) -> None:
    """One rank of a verl-like save: every tensor distributed over a 1-D ("fsdp",) mesh, then torch.save."""
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    state = load_file(str(Path(model_dir) / "model.safetensors"))
    sharded = {}
    for key, tensor in state.items():
        if tensor.dim() == 1:
            placement = Replicate()
        elif "mlp.down_proj" in key:
            placement = Shard(1)  # a non-zero shard dim with an uneven split (intermediate 33 / 2)
        else:
            placement = Shard(0)
        sharded[key] = distribute_tensor(tensor, mesh, [placement])
    torch.save(sharded, Path(actor_dir) / f"model_world_size_{world}_rank_{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=33, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    folder = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def dtensor_actor(tiny_llama_dir, tmp_path_factory) -> Path:
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("dtensor")
    actor = root / "global_step_1" / "actor"
    actor.mkdir(parents=True)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_write_rank_shard, args=(2, str(tiny_llama_dir), str(actor), str(root / "pg_init")), nprocs=2)
    return actor


def test_fsdp_shards_merge_back_exactly(tiny_llama_dir, dtensor_actor, tmp_path):
    from safetensors.torch import load_file

    actor = dtensor_actor
    assert [p.name for p in find_shards(actor)] == ["model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"]
    out = merge_fsdp_shards(actor, tmp_path / "hf", config_dir=tiny_llama_dir)
    original = load_file(str(tiny_llama_dir / "model.safetensors"))
    merged = load_file(str(out / "model.safetensors"))
    assert set(merged) == set(original)
    for key, tensor in original.items():
        assert torch.equal(merged[key], tensor), key
    # the same merge from the command line (`arpo merge-fsdp`) writes the same weights
    cli = subprocess.run([sys.executable, "-m", "flows.cli", "merge-fsdp", str(actor), str(tmp_path / "hf-cli"),
                          "--config-dir", str(tiny_llama_dir)], capture_output=True, text=True, cwd=PROJECT_ROOT)
    assert cli.returncode == 0, cli.stderr[-2000:]
    from_cli = load_file(str(tmp_path / "hf-cli" / "model.safetensors"))
    assert all(torch.equal(from_cli[key], tensor) for key, tensor in merged.items())


def test_streamed_shards_equal_the_reference_assembly(tiny_llama_dir, dtensor_actor, tmp_path):
    """DTensor pieces read through mapped files, a re-open before every tensor, written as several shards: the
    same tensors as the in-memory assembly of fully loaded files, and an index transformers loads."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from stages.rl import fsdp_merge
    from stages.rl.fsdp_merge import merge_state_dicts

    shards = find_shards(dtensor_actor)
    reference = merge_state_dicts([torch.load(p, map_location="cpu", weights_only=False) for p in shards])
    fsdp_merge.GROUP_BYTES, saved = 1, fsdp_merge.GROUP_BYTES
    try:
        out = merge_fsdp_shards(dtensor_actor, tmp_path / "hf", config_dir=tiny_llama_dir, max_shard_bytes=2048)
    finally:
        fsdp_merge.GROUP_BYTES = saved
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    merged = {}
    for file in files:
        part = load_file(str(out / file))
        assert all(index["weight_map"][k] == file for k in part)  # the index names the file that holds it
        merged |= part
    assert set(merged) == set(reference) and all(torch.equal(merged[k], reference[k]) for k in reference)
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()
    assert all(torch.equal(loaded[k], reference[k]) for k in reference)


def test_missing_rank_is_named(tmp_path):
    (tmp_path / "model_world_size_3_rank_0.pt").write_bytes(b"")
    (tmp_path / "model_world_size_3_rank_2.pt").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"ranks \[1\] are missing"):
        find_shards(tmp_path)
    with pytest.raises(FileNotFoundError, match="global_step"):
        find_shards(tmp_path / "empty")


def test_merge_stage_takes_a_verl_checkpoint_in_verl_0_9_1_layout(tmp_path):
    """tests/fixtures/verl_fsdp_0.9.1 was written by that verl's own FSDPCheckpointManager (2 FSDP2 ranks;
    tests/verl/fsdp_fixture.py, layout re-checked by tests/verl/test_checkpoint.py): the merge stage assembles it,
    passes its parity probe and writes bfloat16 weights equal to the original ones rounded."""
    from safetensors.torch import load_file

    from stages.core.config.merge import MergeSection
    from stages.core.refs import CheckpointRef
    from stages.rl.merge import merge_checkpoint

    fixture = PROJECT_ROOT / "tests" / "fixtures" / "verl_fsdp_0.9.1"
    ckpt = CheckpointRef(path=str(fixture / "global_step_1" / "actor"), fingerprint="verl-fixture",
                         format="verl_fsdp", step=1)
    model = merge_checkpoint(MergeSection(dtype="bfloat16"), ckpt, tmp_path)
    assert model.meta["source_format"] == "verl_fsdp" and model.meta["max_abs_diff"] <= 1e-4
    original = load_file(str(fixture / "original" / "model.safetensors"))
    merged = load_file(str(Path(model.path) / "model.safetensors"))
    assert set(merged) == set(original)
    assert all(torch.equal(merged[k], original[k].to(torch.bfloat16)) for k in original)
    assert (Path(model.path) / "tokenizer.json").is_file()
    report = json.loads((Path(model.path).parent / "merge_report.json").read_text())
    assert report["merge_diff"] <= 1e-4 and report["exact_tensors"] == len(original)
    # streamed straight into the stage's folder: no float32 copy, no partial folder left beside it
    assert sorted(p.name for p in Path(model.path).parent.iterdir() if p.is_dir()) == ["model"]


def test_merge_stage_crash_mid_write_leaves_no_model_and_reruns(tmp_path, monkeypatch):
    import safetensors.torch

    from stages.core.config.merge import MergeSection
    from stages.core.refs import CheckpointRef
    from stages.rl.merge import merge_checkpoint

    fixture = PROJECT_ROOT / "tests" / "fixtures" / "verl_fsdp_0.9.1"
    ckpt = CheckpointRef(path=str(fixture / "global_step_1" / "actor"), fingerprint="verl-fixture-crash",
                         format="verl_fsdp", step=1)
    real = safetensors.torch.save_file

    def full_disk(*args, **kwargs):
        real(*args, **kwargs)  # the shard is on disk, then the process "dies"
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(OSError, match="No space"):
        merge_checkpoint(MergeSection(dtype="bfloat16"), ckpt, tmp_path)
    stage = next((tmp_path / "merge").iterdir())
    assert not (stage / "model").exists() and not (stage / "model.partial").exists()
    assert not (stage / "_COMPLETE.json").exists()
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    model = merge_checkpoint(MergeSection(dtype="bfloat16"), ckpt, tmp_path)  # the same folder, now complete
    assert Path(model.path).parent == stage and (Path(model.path) / "model.safetensors").is_file()
