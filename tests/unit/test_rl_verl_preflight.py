"""What a first GPU run of the verl engine would hit, fixed before it runs: the attention verl asks for, the FSDP
version of its checkpoints, the trainer mode verl compares with "sync", partial trees, and resources (Ray CPUs
that TransferQueue reserves, vLLM's memory share per device kind). Pure parts; tests/verl checks them against
the pinned verl itself."""

from __future__ import annotations

import pytest
import torch

from stages.core.config.loader import ConfigError, load_config
from stages.core.config.rl import AdvantageSection
from stages.core.config.rl_engine import VerlSection
from stages.core.errors import DeterministicError
from stages.rl.advantages import compute_advantages
from stages.rl.verl.advantage import PartialTreeError, step_advantages, tree_metrics, whole_trees
from stages.rl.verl.mapping import VerlPaths, verl_overrides
from stages.rl.verl.resources import (
    VerlResourceError,
    check_attention,
    check_memory_share,
    check_ray_cpus,
    cpu_demand,
)

PATHS = VerlPaths(model="/m", train_file="/d/t.parquet", val_file="/d/v.parquet", checkpoints="/o/ck",
                  settings="/o/s.json", agent_loops="/o/a.yaml", rollout_dump="/o/r")
GIB = 2**30


def _overrides(*extra: str, model_type: str | None = None) -> dict[str, str]:
    rl = load_config("tiny-cpu", ["rl.engine=verl", *extra]).rl
    return dict(o.split("=", 1) for o in verl_overrides(rl, "float32", 0, PATHS, model_type))


def test_mapping_asks_for_sdpa_attention_and_fsdp2_checkpoints():
    o = _overrides()
    assert o["+actor_rollout_ref.model.override_config.attn_implementation"] == "sdpa"   # verl's default: flash
    assert o["actor_rollout_ref.actor.strategy"] == o["actor_rollout_ref.ref.strategy"] == "fsdp2"  # verl: fsdp


@pytest.mark.parametrize("extra,model_type,packed", [
    ([], "llama", True), ([], "qwen2", True), ([], "qwen3", True),     # sdpa + a verified family (tests/verl)
    ([], "gemma2", False), ([], None, False),                          # sdpa, family not verified / unknown
    (["rl.verl.attn_implementation=flash_attention_2"], None, True),   # varlen kernel: any family
    (["rl.verl.attn_implementation=eager"], "qwen3", False),           # packed eager: heads x T^2 scores
    (["rl.verl.remove_padding=false", "rl.verl.attn_implementation=flash_attention_2"], "qwen3", False),
    (["rl.verl.remove_padding=true"], "gemma2", True),                 # the user's call
])
def test_remove_padding_auto_follows_attention_and_family(extra, model_type, packed):
    o = _overrides(*extra, model_type=model_type)
    assert o["actor_rollout_ref.model.use_remove_padding"] == ("true" if packed else "false")


def test_the_launcher_reads_the_family_from_the_policy_folder(tmp_path):
    from stages.rl.verl.mapping import model_type_of

    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "hidden_size": 8}')
    assert model_type_of(tmp_path) == "qwen3"
    assert model_type_of(tmp_path / "missing") is None
    (tmp_path / "config.json").write_text("[1, 2]")
    assert model_type_of(tmp_path) is None
    with pytest.raises(ConfigError, match="remove_padding"):
        load_config("tiny-cpu", ["rl.engine=verl", "rl.verl.remove_padding=sometimes"])


def test_mapping_runs_every_algorithm_in_arpo_sync_with_plugin_modules_first():
    for extra in ([], ["rl.advantage.attribution=hard"], ["rl.algorithm=aepo"]):
        assert _overrides(*extra)["trainer.v1.trainer_mode"] == "arpo_sync"
    o = _overrides("rl.verl.plugin_modules=[my.platform]", "rl.verl.storage_units=1", "rl.verl.ray_num_cpus=6",
                   "rl.verl.reward_workers=2")
    assert o["+ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES"] == "'my.platform,stages.rl.verl.plugin'"
    assert o["transfer_queue.backend.SimpleStorage.num_data_storage_units"] == "1"
    assert o["ray_kwargs.ray_init.num_cpus"] == "6" and o["reward.num_workers"] == "2"
    joined = _overrides("rl.verl.ray_num_cpus=6", "rl.verl.ray_address=auto")
    assert joined["ray_kwargs.ray_init.num_cpus"] == "null"           # a joined cluster has its own CPUs


def test_ray_cpu_reservation_is_checked_before_ray_waits_forever():
    # one node, 8 GPUs, verl's 8 storage units: reserved = controller 1 + storage 8 + trainer 3 x 8 = 33;
    # unreserved actors (each placed only where a CPU is free): 8 vLLM servers (TP 1) + 8 agent + 8 reward = 24
    paper = VerlSection()
    assert cpu_demand(paper) == {"transfer_queue_controller": 1, "transfer_queue_storage": 8, "trainer": 24,
                                 "reserved": 33, "headroom": 24, "total": 57}
    with pytest.raises(VerlResourceError, match=r"rl\.verl\.ray_num_cpus=57") as refused:
        check_ray_cpus(paper, [56.0])
    assert isinstance(refused.value, DeterministicError) and "storage_units=1" in str(refused.value)
    assert "24 free for the actors it starts without a reservation" in str(refused.value)
    # exactly the reservations (the old suggested fix) leaves no CPU to place the vLLM / agent / reward actors
    with pytest.raises(VerlResourceError, match="57"):
        check_ray_cpus(paper, [33.0])
    assert check_ray_cpus(paper, [57.0])["need"]["total"] == 57
    # the CPU box (tiny-cpu): 1 unit, 1 "GPU": 1 + 1 + 3 = 5 reserved, + 1 vLLM + 1 agent + 1 reward = 8 > 2 cores
    tiny = VerlSection(n_gpus_per_node=1, storage_units=1, agent_workers=1, reward_workers=1)
    with pytest.raises(VerlResourceError, match=r"ray_num_cpus=8"):
        check_ray_cpus(tiny, [2.0])
    assert check_ray_cpus(tiny, [8.0])["unreserved_actors"] == {"vllm_servers": 1, "agent_loop_workers": 1,
                                                                "reward_workers": 1}
    # a joined cluster: the fix is on the nodes' side
    with pytest.raises(VerlResourceError, match=r"ray start --num-cpus=8"):
        check_ray_cpus(tiny.model_copy(update={"ray_address": "auto"}), [7.0])
    # two nodes share the 8 units (4 each) and the 8 + 8 workers (4 + 4 each); TP 2 = 4 servers a node:
    # 1 + 4 + 24 + (4 + 4 + 4) = 41 on the busiest; both nodes must have them
    two = VerlSection(nnodes=2, rollout_tensor_parallel=2)
    assert cpu_demand(two)["total"] == 41
    with pytest.raises(VerlResourceError, match="41"):
        check_ray_cpus(two, [64.0, 40.0])
    with pytest.raises(VerlResourceError, match="2 node"):
        check_ray_cpus(VerlSection(nnodes=3), [64.0, 64.0])


def test_vllm_memory_share_must_fit_the_device_kind():
    # CPU: 0.6 of 20 GiB = 12 GiB > 11 GiB available -> the largest share that fits with 10 % slack:
    # floor(0.9 * 11 / 20 * 100) / 100 = floor(49.5) / 100 = 0.49
    with pytest.raises(VerlResourceError, match=r"share of RAM.*gpu_memory_utilization=0\.49"):
        check_memory_share(0.6, "cpu", 20 * GIB, 11 * GIB)
    assert check_memory_share(0.1, "cpu", 20 * GIB, 11 * GIB)["available_gib"] == 11.0
    with pytest.raises(VerlResourceError, match="of each GPU"):
        check_memory_share(0.9, "cuda", 80 * GIB, 60 * GIB)
    assert check_memory_share(0.7, "cuda", 80 * GIB, 79 * GIB)["kind"] == "cuda"


def test_flash_attention_is_refused_where_flash_attn_is_missing():
    with pytest.raises(VerlResourceError, match="attn_implementation=sdpa"):
        check_attention("flash_attention_2", flash_attn_installed=False)
    assert check_attention("flash_attention_2", flash_attn_installed=True)
    assert check_attention("sdpa", flash_attn_installed=False)


def _trees():
    """Two trees of n = 3 (tree index 1 branches off 0), rows shuffled as verl's balance_batch does, plus two
    padding rows verl appends (uid pad…, extra fields copied from a real row)."""
    uids = ["v", "u", "pad1", "u", "v", "u", "v", "pad1"]
    index = [1, 0, 0, 2, 0, 1, 2, 0]
    extras = [{"arpo_tree_index": i, "arpo_parent": 0 if i == 1 else -1, "arpo_fork_at": 2} for i in index]
    padding = [u.startswith("pad") for u in uids]
    return uids, extras, padding


def test_only_whole_trees_reach_the_advantage_and_padding_rows_get_zero():
    uids, extras, padding = _trees()
    mask = torch.ones(8, 4)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    rewards = torch.zeros(8, 4)
    rewards[:, -1] = scores
    adv, trees = step_advantages(AdvantageSection(), rewards, mask, uids, extras, padding, n=3)
    assert trees == 2
    assert torch.count_nonzero(adv[[2, 7]]) == 0
    real = [0, 1, 3, 4, 5, 6]
    want = compute_advantages(AdvantageSection(), scores[real], torch.tensor([0, 1, 1, 0, 1, 0]), mask[real])
    assert torch.allclose(adv[real], want, atol=1e-6)
    # a tree that lost a trajectory (tree index 2 of "u") is refused, never normalised over 2 of 3
    with pytest.raises(PartialTreeError, match=r"prompt u .*\[0, 1\]"):
        whole_trees([u for u, r in zip(uids, range(8)) if r != 3 and not padding[r]],
                    [e for e, r in zip(extras, range(8)) if r != 3 and not padding[r]], 3)
    # the step of 3 prompts in which one tree failed and was removed: 2 trained, 1 dropped
    assert tree_metrics(2, 3) == {"rollout/trees_trained": 2.0, "rollout/trees_dropped": 1.0,
                                  "rollout/trees_dropped_infra": 0.0, "rollout/trees_dropped_other": 1.0}


def test_processes_an_earlier_attempt_left_behind_are_found_and_killed(tmp_path):
    """Ray's per-node agents outlive a SIGKILLed launcher; the next attempt finds them by the stage's settings path
    in their environment (and nothing else: the same path in another stage is someone else's run)."""
    import os
    import subprocess
    import sys

    from stages.rl.verl.launch import leftover_processes, reap_leftovers

    mine, other = str(tmp_path / "a" / "plugin_settings.json"), str(tmp_path / "b" / "plugin_settings.json")
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 env={**os.environ, "ARPO_VERL_SETTINGS": path}) for path in (mine, other)]
    try:
        assert leftover_processes(mine) == [sleepers[0].pid]
        reap_leftovers(mine)
        assert sleepers[0].wait(timeout=10) == -9 and sleepers[1].poll() is None
    finally:
        for proc in sleepers:
            proc.kill()
            proc.wait()
