"""The config mapping composes with verl 0.9.1's real hydra schema (ppo_trainer.yaml) and passes verl's own
validation and dataclass conversion, for every profile; the launcher's inputs are what verl reads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stages.core.archs import arch_for
from stages.core.config.loader import load_config, profile_names
from stages.core.env import PROJECT_ROOT
from stages.core.refs import DatasetRef, ModelRef
from stages.core.rl_parquet import make_row, write_rl_parquet
from stages.rl.verl.launch import prepare
from stages.rl.verl.mapping import verl_overrides
from tests.verl.conftest import compose_verl, paths

pytestmark = pytest.mark.verl
ORIGINAL = PROJECT_ROOT / "tests" / "fixtures" / "verl_fsdp_0.9.1" / "original"  # a tiny HF folder + tokenizer


def _validate(cfg) -> None:
    from verl.trainer.config import AlgoConfig  # noqa: F401
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    for section in (cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.algorithm):
        omega_conf_to_dataclass(section)
    assert not need_critic(cfg)


def _profile(name: str):
    return load_config(name, [] if load_config(name).rl.engine == "verl" else ["rl.engine=verl"])


@pytest.mark.parametrize("profile", profile_names())
def test_every_profile_maps_onto_verls_schema(profile, tmp_path):
    from verl.utils.config import omega_conf_to_dataclass

    cfg = _profile(profile)
    rl = cfg.rl
    found = arch_for(cfg.model.name, cfg.model.path)             # the family the launcher reads from config.json
    family = found[1].model_type if found else None
    composed = compose_verl(verl_overrides(rl, cfg.model.dtype, cfg.run.seed, paths(tmp_path), family))
    _validate(composed)
    actor, rollout, trainer = composed.actor_rollout_ref.actor, composed.actor_rollout_ref.rollout, composed.trainer
    assert (rollout.n, rollout.prompt_length, rollout.response_length) == \
        (rl.rollout.n, rl.rollout.max_prompt_length, rl.rollout.max_response_length)
    assert composed.data.train_batch_size == rl.trainer.train_batch_size
    assert actor.ppo_mini_batch_size == rl.trainer.ppo_mini_batch_size  # prompts; verl multiplies by n
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c) == \
        (rl.loss.clip_ratio_low, rl.loss.clip_ratio_high, rl.loss.clip_ratio_c)
    assert actor.optim.lr == rl.optim.lr and actor.optim.lr_scheduler_type == "constant"
    assert rollout.tensor_model_parallel_size == rl.verl.rollout_tensor_parallel
    assert (trainer.save_freq, trainer.resume_mode, trainer.use_v1) == (rl.trainer.save_every, "auto", True)
    assert rollout.agent.default_agent_loop == "arpo_tree"
    assert rollout.agent.agent_loop_manager_class == "stages.rl.verl.agent_loop.ArpoAgentLoopManagerTQ"
    assert composed.algorithm.adv_estimator == "arpo_grpo" and not composed.algorithm.use_kl_in_reward
    assert actor.policy_loss.loss_mode == f"arpo_{rl.loss.policy_loss}"
    assert trainer.v1.trainer_mode == "arpo_sync"                   # verl's sync (test_arpo_sync_is_verls_sync)
    assert actor.strategy == composed.actor_rollout_ref.ref.strategy == "fsdp2"  # the merge's layout
    # model.dtype is the compute dtype: FSDP's mixed precision (verl reads no other key for it)
    assert actor.fsdp_config.mixed_precision.param_dtype == cfg.model.dtype
    assert omega_conf_to_dataclass(actor.fsdp_config).mixed_precision["param_dtype"] == cfg.model.dtype
    model = composed.actor_rollout_ref.model
    assert model.override_config.attn_implementation == rl.verl.attn_implementation
    assert model.use_remove_padding == rl.verl.uses_remove_padding(family)
    if profile != "tiny-cpu":                                     # qwen2 / qwen3 under sdpa: packed (auto)
        assert model.use_remove_padding and model.override_config.attn_implementation == "sdpa"
    assert composed.transfer_queue.backend.SimpleStorage.num_data_storage_units == rl.verl.storage_units
    assert composed.reward.num_workers == rl.verl.reward_workers
    env = composed.ray_kwargs.ray_init.runtime_env.env_vars
    assert env.VERL_USE_EXTERNAL_MODULES == "stages.rl.verl.plugin" and env.ARPO_VERL_SETTINGS


def test_paper_profiles_resolve_to_the_verl_engine():
    papers = [p for p in profile_names() if p != "tiny-cpu"]
    assert papers and all(load_config(p).rl.engine == "verl" for p in papers)


def test_launcher_inputs_compose_and_verl_reads_its_dataset(tmp_path):
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    rows = [make_row(i, "toy", "qa", "sys", f"What is {i}", str(i), "train") for i in range(4)]
    data = DatasetRef(path=str(tmp_path), fingerprint="d", files={
        "rl_train": str(write_rl_parquet(rows, tmp_path / "train.parquet")),
        "rl_valid": str(write_rl_parquet(rows[:2], tmp_path / "valid.parquet"))})
    cfg = load_config("tiny-cpu", ["rl.engine=verl", "rl.advantage.attribution=hard"])
    stage = tmp_path / "stage"
    overrides, p, _ = prepare(cfg.rl, cfg.agent, ModelRef(path=str(ORIGINAL), fingerprint="m"), data, stage,
                              tmp_path / "cache", 0, "float32")
    composed = compose_verl(overrides)
    _validate(composed)
    assert composed.trainer.v1.trainer_mode == "arpo_sync"
    assert composed.actor_rollout_ref.model.use_remove_padding      # the folder's config.json: llama, under sdpa
    assert (stage / "verl_inputs" / "overrides.txt").read_text().splitlines() == overrides
    assert Path(composed.actor_rollout_ref.rollout.agent.agent_loop_config_path).read_text().startswith(
        "- name: arpo_tree")
    dataset = RLHFDataset(p.train_file, AutoTokenizer.from_pretrained(str(ORIGINAL)), composed.data)
    item = dataset[2]
    assert item["index"] == 2 and item["raw_prompt"][-1]["content"] == "What is 2"
    assert item["reward_model"]["ground_truth"] == "2" and item["ability"] == "qa"


def test_prompt_template_token_ids_agree_across_environments():
    """transformers 5.9 (this env) vs the project venv's 5.6 on the same tokenizer folder."""
    from stages.rl.verl.parity import check_parity

    main_python = PROJECT_ROOT / ".venv" / "bin" / "python"
    if not main_python.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{main_python} is missing; ./scripts/setup.sh builds it")
        pytest.skip("the project venv is not built here")
    report = check_parity(str(ORIGINAL), [[{"role": "user", "content": "What is 6*7?"}]], str(main_python))
    assert report["checked"] and report["prompts"] == 1


def test_the_actor_builds_with_the_mapped_attention_where_flash_attn_is_missing(tmp_path):
    """verl asks for flash_attention_2 unless told otherwise (verl/workers/config/model.py:185) and verl[vllm] does
    not install flash-attn (this environment has none either): the actor is built as verl's FSDP engine builds it
    (workers/engine/fsdp/transformer_impl.py:276) from the config our mapping composes."""
    import importlib.util

    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.model import get_hf_auto_model_class

    from stages.rl.verl.resources import VerlResourceError, check_attention

    assert importlib.util.find_spec("flash_attn") is None
    cfg = load_config("tiny-cpu", ["rl.engine=verl"])
    mapped = paths(tmp_path).__dict__ | {"model": str(ORIGINAL)}
    composed = compose_verl(verl_overrides(cfg.rl, "float32", 0, type(paths(tmp_path))(**mapped)))
    model_config = omega_conf_to_dataclass(composed.actor_rollout_ref.model)
    assert model_config.hf_config._attn_implementation == "sdpa"
    module = get_hf_auto_model_class(hf_config=model_config.hf_config).from_pretrained(
        model_config.local_path, config=model_config.hf_config)
    assert module.config._attn_implementation == "sdpa"
    with pytest.raises(VerlResourceError, match="flash-attn is not installed"):   # the pre-flight's refusal
        check_attention("flash_attention_2", importlib.util.find_spec("flash_attn") is not None)


def test_arpo_sync_is_verls_sync_everywhere_verl_compares_the_mode(tiny_verl_config):
    """verl compares the mode with the literal "sync" (v1/trainer_base.py: replay buffer class :153, exact refill
    and gen_batch_size :731, TransferQueue restore :902, re-issue on resume :912, TransferQueue checkpoint :1004,
    prompt dispatch :1499). Our mode must take every sync branch."""
    import inspect
    import re

    from verl.trainer.ppo.v1 import get_trainer_cls, trainer_base
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

    import stages.rl.verl.plugin  # noqa: F401

    compared = re.findall(r'self\.trainer_mode\s*[!=]=\s*"(\w+)"', inspect.getsource(trainer_base))
    assert compared == ["sync"] * 6          # verl 0.9.1; a new comparison must be looked at
    assert tiny_verl_config.trainer.v1.trainer_mode == "arpo_sync"
    trainer = get_trainer_cls("arpo_sync")(tiny_verl_config)
    assert trainer.trainer_mode == "sync"
    assert type(trainer.replay_buffer) is ReplayBuffer and not isinstance(trainer.replay_buffer, ReplayBufferAsync)
    assert trainer.replay_buffer.trainer_mode == "sync"
    assert trainer.replay_buffer.gen_batch_size == tiny_verl_config.data.train_batch_size  # not 1 (async refill)
    assert trainer._reissue_inflight_prompts() == 0                 # returns before touching TransferQueue
    with pytest.raises(ValueError, match="arpo_sync"):
        trainer.trainer_mode = "colocate_async"


def test_cpu_reservations_of_the_preflight_are_verls_and_transferqueues():
    """The numbers stages.rl.verl.resources checks against (a cluster without them makes Ray wait forever)."""
    from transfer_queue.controller import TransferQueueController
    from transfer_queue.storage.simple_storage import SimpleStorageUnit
    from verl.single_controller.ray.base import ResourcePoolManager

    from stages.rl.verl import resources

    assert TransferQueueController._default_options["num_cpus"] == resources.TQ_CONTROLLER_CPUS
    assert SimpleStorageUnit._default_options["num_cpus"] == resources.TQ_STORAGE_UNIT_CPUS
    assert ResourcePoolManager.max_colocate_count == resources.TRAINER_CPUS_PER_GPU
