"""verl 0.9.1's weight sync sends a tied LM head under both its names, the names our local engine's vLLM refresh sends.

Before each step's rollouts verl's actor worker hands `FSDPEngine.get_per_tensor_param()` (its FSDP2 module's
`state_dict()` through `convert_weight_keys`, `workers/engine/fsdp/transformer_impl.py:977-1061`) to the rollout's
`update_weights`; on the CPU our receiver passes those (name, tensor) pairs unchanged to vLLM's in-place reload
(stages/rl/verl/cpu_platform.py), the call the local engine's vLLM backend makes with `trainer_tensors(model)`
(stages/generation/weight_sync.py). tests/integration/test_rl_weight_sync.py shows that reload keeps a tied head in
sync from those names (and refuses the refresh that named the head once). So a tied policy follows training on verl
when verl sends the same names and values: checked here on a tied llama under FSDP2, on one gloo rank, in a fresh
process with the CPU platform verl's processes import in CPU mode. (The suite's one verl run trains an untied toy
Qwen3; docs/testing.md, "Coverage of the heavy modules", row V11.)
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.verl.fsdp_fixture import tiny_model

pytestmark = pytest.mark.verl


def _send(rank: int, out: str) -> None:
    """What verl's actor sends, as {name: full tensor}, into <out>/sent.pt (torch.multiprocessing.spawn target)."""
    import importlib

    importlib.import_module("stages.rl.verl.cpu_platform")  # first, as in every verl process in CPU mode
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/.pg_init", rank=rank, world_size=1)
    model = tiny_model(tie_word_embeddings=True)
    torch.save({name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)},
               f"{out}/trainer.pt")
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    engine = SimpleNamespace(module=model, _uses_fsdp2_cpu_offload_policy=False, _is_offload_param=False,
                             _qat_enabled=False, model_config=SimpleNamespace(lora={}, hf_config=model.config))
    params, peft = FSDPEngine.get_per_tensor_param(engine, layered_summon=False, base_sync_done=True)  # as the worker
    assert peft is None
    torch.save({name: tensor.detach().clone() for name, tensor in params}, f"{out}/sent.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def sent(tmp_path_factory) -> tuple[dict, dict]:
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("weight-sender")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_send, args=(str(out),), nprocs=1)
    return torch.load(Path(out) / "sent.pt"), torch.load(Path(out) / "trainer.pt")


def test_verl_sends_a_tied_head_under_both_names_as_our_vllm_refresh_does(sent):
    from stages.generation.weight_sync import trainer_tensors

    verl, trainer = sent
    assert "lm_head.weight" in verl and "model.embed_tokens.weight" in verl
    assert torch.equal(verl["lm_head.weight"], verl["model.embed_tokens.weight"])
    ours = dict(trainer_tensors(tiny_model(tie_word_embeddings=True)))  # the local engine's refresh of the same model
    assert sorted(verl) == sorted(ours) == sorted(trainer)    # the same names
    assert all(torch.equal(verl[name], trainer[name]) for name in trainer)
