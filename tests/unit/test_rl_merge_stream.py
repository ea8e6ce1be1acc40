"""The streamed verl merge (stages/rl/fsdp_merge.py, stages/rl/shard_writer.py) on a tiny Llama whose state dict is
split into plain-tensor rank files (dim 0 over 2 ranks, verl's rule for non-DTensor values; the DTensor path runs
on real gloo ranks in tests/integration/test_rl_merge_fsdp.py): exact equality with the in-memory reference
assembly, the shard plan and index, atomicity on a crash, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stages.rl import fsdp_merge
from stages.rl.fsdp_merge import (
    Entry,
    check_layout,
    find_shards,
    load_rank_state,
    merge_fsdp_shards,
    merge_state_dicts,
    meta_model,
    read_layout,
    stream_assembled,
    write_merged_folder,
)
from stages.rl.merge_weights import MergeParityError, put_assembled_weights
from stages.rl.shard_writer import INDEX_FILE, partial_folder, plan_shards, shard_file_names, write_shards

torch.set_num_threads(1)


def _config(tied: bool):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=33, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=tied)


def _write_actor(root: Path, tied: bool = False, legacy: bool = False, config=None
                 ) -> tuple[Path, dict[str, torch.Tensor]]:
    """<root>/actor with 2 plain-tensor rank files (FSDP wrapper prefix on every key, dim 0 split unevenly where
    the size is odd) and huggingface/config.json; returns the folder and the original state dict."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config or _config(tied))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    actor = root / "actor"
    model.config.save_pretrained(actor / "huggingface")
    for rank in range(2):
        part = {f"_fsdp_wrapped_module.{k}": torch.tensor_split(v, 2, dim=0)[rank].clone() for k, v in state.items()}
        torch.save(part, actor / f"model_world_size_2_rank_{rank}.pt", _use_new_zipfile_serialization=not legacy)
    return actor, state


def _read_folder(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out |= load_file(str(file))
    return out


def test_plan_closes_a_shard_before_it_would_pass_the_limit():
    # limit 8: a(4)+b(4)=8 fits; c(10) alone exceeds it and gets its own shard; d(2) opens the third
    assert plan_shards({"a": 4, "b": 4, "c": 10, "d": 2}, 8) == [["a", "b"], ["c"], ["d"]]
    assert plan_shards({"a": 4, "b": 4}, 100) == [["a", "b"]]
    assert shard_file_names(1) == ["model.safetensors"]
    assert shard_file_names(2) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    with pytest.raises(ValueError, match="max_bytes"):
        plan_shards({"a": 1}, 0)


def test_write_shards_index_names_the_file_that_holds_each_tensor(tmp_path):
    from safetensors import safe_open

    tensors = {"w1": torch.ones(2, 3), "w2": torch.zeros(5, dtype=torch.bfloat16), "w3": torch.arange(4.0)}
    sizes = {k: v.numel() * v.element_size() for k, v in tensors.items()}  # 24, 10, 16 bytes
    plan = plan_shards(sizes, 30)  # [w1], [w2, w3]: 24 + 10 > 30, 10 + 16 <= 30
    index = write_shards(iter(tensors.items()), plan, tmp_path)
    assert index == json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"] == {"total_size": 50, "total_parameters": 6 + 5 + 4}
    assert index["weight_map"] == {"w1": "model-00001-of-00002.safetensors", "w2": "model-00002-of-00002.safetensors",
                                   "w3": "model-00002-of-00002.safetensors"}
    for name, file in index["weight_map"].items():
        with safe_open(str(tmp_path / file), "pt") as handle:
            assert handle.metadata() == {"format": "pt"}
            assert torch.equal(handle.get_tensor(name), tensors[name])
    with pytest.raises(ValueError, match="where the shard plan has"):
        write_shards(iter([("w2", tensors["w2"])]), [["w1"]], tmp_path / "order")
    with pytest.raises(ValueError, match="ended before"):
        write_shards(iter([]), [["w1"]], tmp_path / "short")
    with pytest.raises(ValueError, match="not in the shard plan"):
        write_shards(iter(tensors.items()), [["w1"]], tmp_path / "long")


def test_partial_folder_is_renamed_on_success_and_removed_on_failure(tmp_path):
    target = tmp_path / "model"
    (tmp_path / "model.partial").mkdir()
    (tmp_path / "model.partial" / "stale").write_text("left by a killed run")
    with partial_folder(target) as tmp:
        assert not (tmp / "stale").exists()  # the dead run's files are gone before the new ones are written
        (tmp / "a").write_text("1")
    assert (target / "a").is_file() and not (tmp_path / "model.partial").exists()
    with pytest.raises(RuntimeError, match="crash"), partial_folder(target) as tmp:
        (tmp / "b").write_text("half")
        raise RuntimeError("crash")
    assert (target / "a").is_file() and not (target / "b").exists() and not (tmp_path / "model.partial").exists()


@pytest.mark.parametrize("legacy", [False, True])
def test_stream_equals_the_reference_assembly_with_reloads(tmp_path, monkeypatch, legacy):
    actor, original = _write_actor(tmp_path, legacy=legacy)
    shards = find_shards(actor)
    assert load_rank_state(shards[0])[1] is (not legacy)  # the legacy (pre-zip) format cannot be mapped
    reference = merge_state_dicts([torch.load(p, weights_only=False) for p in shards])
    entries = read_layout([load_rank_state(p)[0] for p in shards])
    assert [e.name for e in entries] == list(original)
    assert all(e.shape == tuple(original[e.name].shape) for e in entries)
    opened = []
    monkeypatch.setattr(fsdp_merge, "load_rank_state", lambda p: opened.append(p) or load_rank_state(p))
    # group_bytes=1: mapped files are re-opened before every tensor (21 tensors x 2 ranks); unmapped ones once
    streamed = dict(stream_assembled(shards, entries, group_bytes=1))
    assert len(opened) == (2 if legacy else 2 * len(entries))
    assert list(streamed) == list(reference) and all(torch.equal(streamed[k], reference[k]) for k in reference)
    as_bf16 = dict(stream_assembled(shards, entries, dtype=torch.bfloat16))
    assert all(torch.equal(as_bf16[k], original[k].to(torch.bfloat16)) for k in original)


def test_torch_without_mmap_loads_whole_files(tmp_path, monkeypatch):
    actor, original = _write_actor(tmp_path)
    real = torch.load

    def old_torch_load(f, map_location=None, weights_only=False):  # torch < 2.1: no mmap argument
        return real(f, map_location=map_location, weights_only=weights_only)

    monkeypatch.setattr(torch, "load", old_torch_load)
    state, mapped = load_rank_state(find_shards(actor)[0])
    assert not mapped and len(state) == len(original)


@pytest.mark.parametrize("tied", [False, True])
def test_streamed_folder_equals_save_pretrained_of_the_reference(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    actor, original = _write_actor(tmp_path, tied=tied)
    reference = merge_fsdp_shards_in_memory(actor, tmp_path / "reference")
    out = merge_fsdp_shards(actor, tmp_path / "streamed", dtype=torch.bfloat16, max_shard_bytes=4096)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and (out / INDEX_FILE).is_file()
    streamed, saved = _read_folder(out), _read_folder(reference)
    assert set(streamed) == set(saved)  # save_pretrained's names: the tied lm_head left out
    assert ("lm_head.weight" in streamed) is not tied
    assert all(torch.equal(streamed[k], saved[k].to(torch.bfloat16)) for k in saved)
    index = json.loads((out / INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == set(files) and set(index["weight_map"]) == set(streamed)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in streamed.values())
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, original[name].to(torch.bfloat16).float()), name


def merge_fsdp_shards_in_memory(actor: Path, out: Path) -> Path:
    with partial_folder(out) as tmp:
        write_merged_folder(actor, tmp, in_memory=True)
    return out


def test_a_crash_mid_write_leaves_no_folder(tmp_path, monkeypatch):
    import safetensors.torch

    actor, _ = _write_actor(tmp_path)
    real, calls = safetensors.torch.save_file, []

    def failing(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise OSError("No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    with pytest.raises(OSError, match="No space"):
        merge_fsdp_shards(actor, tmp_path / "hf", max_shard_bytes=4096)
    assert len(calls) == 2  # one shard was on disk when the second failed
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.partial").exists()


def test_architecture_with_save_time_conversion_goes_the_in_memory_way(tmp_path):
    """transformers 5 fuses Qwen3-MoE experts into one tensor per layer in the module and splits them per expert in
    the files (save_pretrained's conversion): verl saves the fused module names, the folder must have the split."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                            num_experts=4, num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
    assert fsdp_merge.has_weight_conversion(meta_model(config))
    assert not fsdp_merge.has_weight_conversion(meta_model(_config(tied=False)))
    actor, original = _write_actor(tmp_path, config=config)
    out = merge_fsdp_shards(actor, tmp_path / "hf")
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in load_file(str(out / "model.safetensors"))
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()
    assert set(loaded) == set(original) and all(torch.equal(loaded[k], original[k]) for k in original)


def test_layout_that_does_not_fit_the_model_is_refused_before_writing(tmp_path):
    model = meta_model(_config(tied=False))
    good = [Entry(n, n, tuple(t.shape), torch.float32) for n, t in model.state_dict().items()]
    assert check_layout(good, model) == set()
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):
        check_layout(good[:-1], model)
    wrong = [*good[:-1], Entry("lm_head.weight", "lm_head.weight", (16, 64), torch.float32)]
    with pytest.raises(ValueError, match=r"lm_head.weight \(16, 64\) vs \(64, 16\)"):
        check_layout(wrong, model)
    tied = meta_model(_config(tied=True))
    assert check_layout(good, tied) == {"lm_head.weight"}  # written by the run, left out of the folder


def test_sharded_tensor_is_refused_by_name():
    class ShardedTensor:  # FSDP1's type, as its name reaches the merge
        pass

    with pytest.raises(ValueError, match="FSDP1 ShardedTensor.*fsdp2"):
        read_layout([{"w": ShardedTensor()}])


def test_put_assembled_weights_checks_every_tensor_bit_for_bit():
    layer = torch.nn.Linear(3, 2, bias=False)
    exact = torch.randn(2, 3)
    with torch.no_grad():
        layer.weight.copy_(exact.to(torch.bfloat16).float())  # what loading the bf16 folder in float32 gives
    put_assembled_weights(layer, iter([("weight", exact)]), torch.bfloat16)
    assert torch.equal(layer.weight, exact)  # the unrounded values are now in place for the rounding probe
    with pytest.raises(MergeParityError, match="weight in the merged folder differs"):
        put_assembled_weights(layer, iter([("weight", exact + 1)]), torch.bfloat16)
    with pytest.raises(MergeParityError, match="not in the model"):
        put_assembled_weights(layer, iter([("bias", exact)]), torch.bfloat16)
