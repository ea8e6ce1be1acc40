"""The tree agent loop over a scripted server speaking verl's generate API, through our worker override, verl's
reward manager with our reward, and verl's advantage paths.

Scripted model (character-level ids of tests/unit/test_rl_rollout_fakes.ToyTokenizer): the first segment is
`<think>a</think><search>q</search>`; after the tool result it answers by the request seed: seed % 3 == 0 ->
`\\boxed{42}` (correct, reward 1), 1 -> `\\boxed{7}` (reward 0), 2 -> no <think> pair -> format error (reward -1).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from stages.agent.protocol import render_result
from stages.agent.rewards import compute_rewards
from stages.core.config.rl import AdvantageSection
from stages.rl.advantages import compute_advantages, owner_matrix
from tests.unit.test_rl_rollout_fakes import ToyTokenizer, ToyToolBox

pytestmark = pytest.mark.verl
FIRST = "<think>a</think><search>q</search>"
ANSWERS = ["<think>b</think><answer>\\boxed{42}</answer>", "<think>b</think><answer>\\boxed{7}</answer>",
           "<answer>\\boxed{42}</answer>"]


class ScriptedServer:
    """`LLMServerClient.generate(request_id, *, prompt_ids, sampling_params) -> TokenOutput` of verl 0.9.1."""

    def __init__(self, tokenizer: ToyTokenizer, script=None) -> None:
        self.tokenizer, self.request_ids, self.params = tokenizer, [], []
        self.script = script or (lambda context, seed: ANSWERS[seed % 3] + "\x00" if "<result>" in context else FIRST)
        self.turns = lambda params: 1   # event-loop turns a request takes (a test may reorder the answers)

    async def generate(self, request_id, *, prompt_ids, sampling_params, **_):
        from verl.workers.rollout.replica import TokenOutput

        self.request_ids.append(request_id)
        self.params.append(dict(sampling_params))
        context = self.tokenizer.decode(prompt_ids)
        text = self.script(context, sampling_params["seed"])
        ids = [0 if ch == "\x00" else self.tokenizer.index[ch] for ch in text][:sampling_params["max_tokens"]]
        for _ in range(self.turns(sampling_params)):
            await asyncio.sleep(0)
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids), stop_reason="completed",
                           extra_fields={"num_cached_tokens": len(prompt_ids) // 2, "global_steps": 2})


def sample(uid="u1", index=7, step=3):
    return {"uid": uid, "index": index, "global_steps": step, "data_source": "toy", "ability": "qa",
            "raw_prompt": [{"role": "user", "content": "What is 6*7?"}], "reward_model": {"ground_truth": "42"},
            "extra_info": {"index": index}, "agent_name": "arpo_tree"}


def make_worker(config, monkeypatch, script=None, real_tools=False):
    """verl's TransferQueue worker (our subclass) without Ray: a scripted server (`script(context, seed) -> text`),
    TransferQueue captured in memory, verl's NaiveRewardManager with our compute_score (loaded by verl from the
    mapping's reward config). `real_tools`: the worker builds its ToolBox from the plugin settings, as in verl's
    actors (stages/rl/verl/tree.py shared_toolbox); else ToyToolBox."""
    import transfer_queue as tq
    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager
    from verl.trainer.ppo.reward import get_custom_reward_fn

    from stages.rl.verl import agent_loop

    tokenizer, store = ToyTokenizer(), {"puts": [], "status": []}
    asyncio.set_event_loop(asyncio.new_event_loop())  # verl's reward manager binds the current loop
    manager = NaiveRewardManager(config, tokenizer, get_custom_reward_fn(config))
    worker = object.__new__(agent_loop.ArpoAgentLoopWorker)
    server = ScriptedServer(tokenizer, script)
    worker.__dict__.update(config=config, llm_client=SimpleNamespace(generate=server.generate), tokenizer=tokenizer,
                           processor=None, distillation_enabled=False, tools=[], dataset_cls=None, hf_model_type=None,
                           mm_processor_kwargs={},
                           reward_loop_worker_handles=[SimpleNamespace(
                               compute_score=SimpleNamespace(remote=manager.run_single))])
    loop = object.__new__(agent_loop.ArpoTreeAgentLoop)
    loop.__dict__.update(server_manager=worker.llm_client, tokenizer=tokenizer,
                         rollout_config=config.actor_rollout_ref.rollout)
    monkeypatch.setattr(worker, "_tree_loop", lambda: loop)
    if not real_tools:
        monkeypatch.setattr(agent_loop, "shared_toolbox", lambda settings: ToyToolBox())

    async def kv_put(key, partition_id, tag):
        store["status"].append((key, tag["status"]))

    async def kv_batch_put(keys, fields, tags, partition_id):
        store["puts"].append((list(keys), fields, tags))

    from verl.trainer.ppo.v1 import agent_loop_tq

    convert = agent_loop_tq.list_of_dict_to_tensordict
    store["rows"] = []
    monkeypatch.setattr(agent_loop_tq, "list_of_dict_to_tensordict",
                        lambda dicts: (store["rows"].extend(dicts), convert(dicts))[1])
    async def kv_clear(keys, partition_id):
        store["cleared"].extend(keys)

    store["cleared"] = []
    monkeypatch.setattr(tq, "async_kv_put", kv_put)
    monkeypatch.setattr(tq, "async_kv_batch_put", kv_batch_put)
    monkeypatch.setattr(tq, "async_kv_clear", kv_clear)
    return worker, server, store


def run_prompt(worker, prompt, validate=False):
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    trajectory = {"step": prompt["global_steps"], "sample_index": prompt["index"], "rollout_n": 0, "validate": validate}
    asyncio.get_event_loop().run_until_complete(worker._run_prompt(dict(prompt), params, trajectory))


def stored(store):
    """Every trajectory put into TransferQueue, converted the way verl converts them (jagged per-row tensors)."""
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    keys = [k for put_keys, _, _ in store["puts"] for k in put_keys]
    return keys, list_of_dict_to_tensordict(store["rows"])


def test_tree_loop_yields_n_trajectories_as_n_sessions_with_n_rewards(tiny_verl_config, settings_file, monkeypatch):
    settings_file()
    worker, server, store = make_worker(tiny_verl_config, monkeypatch)
    run_prompt(worker, sample())
    keys, data = stored(store)
    assert keys == ["u1_0_0", "u1_1_0", "u1_2_0", "u1_3_0"]          # n = 4 sessions of one uid, one output each
    assert store["status"] == [("u1", "running"), ("u1", "finished")]
    assert set(server.request_ids) == {"u1"}                         # one request id: one replica, prefix cache
    tok = ToyTokenizer()
    extras = list(data["extra_fields"])
    assert [e["arpo_kind"] for e in extras].count("branch") >= 1      # branch_probability 1: the tree branched
    assert {(e["min_global_steps"], e["max_global_steps"]) for e in extras} == {(2, 2)}  # weights that served it
    # the tree's time split rides every trajectory (our trainer mode reads it: stages/rl/verl/monitor.py TIME_FIELDS)
    assert len({(e["arpo_time_generate_s"], e["arpo_time_tools_s"], e["arpo_calls_per_round"]) for e in extras}) == 1
    assert extras[0]["arpo_time_generate_s"] > 0 and extras[0]["arpo_calls_per_round"] > 0
    # the tree's decisions survive verl's conversion (stages/rl/tree_record.py): the copy's draw on its parent
    from stages.rl.tree_record import extra_tree_fields

    trees = [extra_tree_fields(e, data["responses"][r].tolist(), data["response_mask"][r].tolist(), tok)
             for r, e in enumerate(extras)]
    assert {(d["child"], d["at"]) for t in trees for d in t["tree"]["draws"] if d["branch"]} == {
        (e["arpo_tree_index"], e["arpo_fork_at"]) for e in extras if e["arpo_kind"] == "branch"}
    rewards = []
    for row in range(4):
        ids = data["responses"][row].tolist()
        mask = data["response_mask"][row].tolist()
        result = tok.encode(render_result("R:q"), add_special_tokens=False)  # the tool result as appended
        start = next(i for i in range(len(ids)) if ids[i:i + len(result)] == result)
        # tool-result tokens have mask 0, every model token (before and after) mask 1
        assert mask == [1] * start + [0] * len(result) + [1] * (len(ids) - start - len(result))
        expected = compute_rewards("reference", [tok.decode(ids, skip_special_tokens=True)], ["42"], ["qa"])[0].score
        score = data["rm_scores"][row]
        assert score.sum().item() == pytest.approx(expected) and score[-1].item() == pytest.approx(expected)
        rewards.append(expected)
    assert len(set(rewards)) > 1                                      # n rewards, not one copied reward


def test_stock_list_return_path_would_copy_one_reward_to_every_trajectory(tiny_verl_config, settings_file,
                                                                          monkeypatch):
    """Why the worker override exists: verl's own path for a list of outputs treats them as one episode."""
    from verl.experimental.agent_loop.agent_loop import (
        AgentLoopMetrics,
        AgentLoopOutput,
    )
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

    from stages.rl.verl.tree import rollout_tree

    settings = settings_file()
    worker, server, store = make_worker(tiny_verl_config, monkeypatch)
    loop = asyncio.get_event_loop()
    fields = loop.run_until_complete(rollout_tree(server.generate, worker.tokenizer, ToyToolBox(), settings, sample(),
                                                  {"temperature": 1.0}, global_step=3, validate=False, val_n=1,
                                                  request_id="u1"))
    outputs = [AgentLoopOutput(**{k: v for k, v in f.items() if k != "metrics"}, metrics=AgentLoopMetrics())
               for f in fields]
    kwargs = {k: v for k, v in sample().items() if k != "agent_name"}
    postprocess = AgentLoopWorkerTQ.__ray_actor_class__._agent_loop_postprocess
    loop.run_until_complete(postprocess(worker, outputs, False, session_id=0, **kwargs))
    keys, data = stored(store)
    assert keys == ["u1_0_0", "u1_0_1", "u1_0_2", "u1_0_3"]           # one session: GRPO would keep only u1_0_3
    last = data["rm_scores"][3].sum().item()
    assert all(data["rm_scores"][r].sum().item() == last for r in range(4))  # the last reward copied to all


def test_trees_grow_by_the_algorithm_and_validation_samples_independently(tiny_verl_config, settings_file,
                                                                          monkeypatch):
    """The workers read rl.algorithm from the plugin settings (there is no rollout key for it); validation trees
    are val_n independent samples whatever the training algorithm."""
    from stages.rl.verl.tree import rollout_tree

    kinds = {}
    for algorithm, validate in (("arpo", False), ("grpo", False), ("arpo", True)):
        settings = settings_file(algorithm=algorithm)
        worker, server, _ = make_worker(tiny_verl_config, monkeypatch)
        fields = asyncio.get_event_loop().run_until_complete(rollout_tree(
            server.generate, worker.tokenizer, ToyToolBox(), settings, sample(), {"temperature": 1.0}, global_step=3,
            validate=validate, val_n=2, request_id="u1"))
        kinds[algorithm, validate] = [f["extra_fields"]["arpo_kind"] for f in fields]
    # tau = 1, w = 0 (conftest): every arpo candidate copies while budget lasts; grpo samples all n from the prompt
    assert kinds["arpo", False].count("branch") == 2 and len(kinds["arpo", False]) == 4
    assert kinds["grpo", False] == ["root"] * 4 and kinds["arpo", True] == ["root"] * 2


def test_verl_advantage_paths_on_our_output_equal_our_advantages(tiny_verl_config, settings_file, monkeypatch):
    from verl.protocol import DataProto
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    import stages.rl.verl.plugin  # noqa: F401
    from stages.rl.verl.trainer_mode import advantages_from_store

    settings_file()
    worker, _, store = make_worker(tiny_verl_config, monkeypatch)
    run_prompt(worker, sample("u1", 7))
    run_prompt(worker, sample("u2", 8))
    keys, data = stored(store)
    mask = data["response_mask"].to_padded_tensor(0).float()
    scores = data["rm_scores"].to_padded_tensor(0.0)
    rewards = scores.sum(-1)
    group = torch.tensor([0] * 4 + [1] * 4)
    # 1. soft attribution: verl's v1 multi-trajectory path with our registered estimator (what the trainer calls)
    proto = DataProto.from_dict(tensors={"token_level_rewards": scores, "response_mask": mask},
                                non_tensors={"uid": np.array([k.split("_")[0] for k in keys], dtype=object)})
    out = compute_advantage_for_multi_trajectories(proto, keys, "arpo_grpo", num_repeat=4, config=None)
    expected = compute_advantages(AdvantageSection(), rewards, group, mask)
    assert torch.allclose(out.batch["advantages"], expected, atol=1e-6)
    assert torch.count_nonzero(expected * (1 - mask)) == 0           # zero on tool tokens and padding
    # verl's own `grpo` on the same keys sees one group of n = 4 per prompt (sessions 0..3, one output each):
    # identical to ours here (groups larger than one, same eps)
    stock = compute_advantage_for_multi_trajectories(
        DataProto.from_dict(tensors={"token_level_rewards": scores, "response_mask": mask},
                            non_tensors={"uid": np.array([k.split("_")[0] for k in keys], dtype=object)}),
        keys, "grpo", num_repeat=4, config=None)
    assert torch.allclose(stock.batch["advantages"], expected, atol=1e-5)
    # 2. hard attribution + AEPO entropy-aware (trainer mode arpo_sync) on the stored rows, shuffled as verl's
    #    balance_batch may do, with entropies as verl's old-log-prob pass stores them
    cfg = AdvantageSection(attribution="hard", entropy_aware=True)
    settings_file(advantage=cfg)
    entropy = torch.rand_like(mask)
    perm = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    rows = [dict(store["rows"][p], entropy=entropy[p][:len(store["rows"][p]["response_mask"])]) for p in perm.tolist()]
    extras = [r["extra_fields"] for r in store["rows"]]
    data = list_of_dict_to_tensordict(rows)
    out, trees, _ = advantages_from_store(data, [False] * 8, n=4)
    got = out["advantages"].to_padded_tensor(0.0)
    assert trees == 2
    parents = [(4 * (i // 4) + e["arpo_parent"]) if e["arpo_parent"] >= 0 else None for i, e in enumerate(extras)]
    owner = owner_matrix(parents, [e["arpo_fork_at"] for e in extras], mask.shape[1])
    want = compute_advantages(cfg, rewards, group, mask, owner, entropy)[perm]
    assert torch.allclose(got, want[:, :got.shape[1]], atol=1e-6)


def test_a_tree_that_fails_midway_leaves_no_trajectory_behind(tiny_verl_config, settings_file, monkeypatch):
    """verl's sync sampler keeps a failed prompt's stored trajectories sampleable (replay_buffer.py: "failed groups
    remain sampleable"); a tree whose third session fails must not reach the advantage as 2 of 4."""
    settings_file()
    worker, _, store = make_worker(tiny_verl_config, monkeypatch)
    postprocess = type(worker).__mro__[1]._agent_loop_postprocess
    calls = []

    async def failing(self, output, validate, **kwargs):
        calls.append(kwargs["session_id"])
        if kwargs["session_id"] == 2:
            raise RuntimeError("reward worker died")
        return await postprocess(self, output, validate, **kwargs)

    monkeypatch.setattr(type(worker), "_agent_loop_postprocess", failing)
    run_prompt(worker, sample())
    keys, _ = stored(store)
    assert calls == [0, 1, 2] and keys == ["u1_0_0", "u1_1_0"]         # two sessions were stored ...
    assert store["cleared"] == ["u1_0_0", "u1_1_0"]                      # ... and removed again
    assert store["status"] == [("u1", "running"), ("u1", "failure")]


def test_an_unanswered_generate_request_drops_the_tree_as_an_infra_failure(tiny_verl_config, settings_file,
                                                                           monkeypatch):
    """A server that never answers: past rl.rollout.generate_timeout_s the tree loop gives up, the worker marks the
    prompt failed with nothing stored, and the failure is recorded as infrastructure (rollout/trees_dropped_infra)."""
    from stages.rl.verl import agent_loop

    settings_file(generate_timeout_s=0.3)
    worker, _, store = make_worker(tiny_verl_config, monkeypatch)

    async def never(request_id, *, prompt_ids, sampling_params, **_):
        await asyncio.Event().wait()

    worker.llm_client.generate = never
    faults = []
    record = agent_loop.record_failure
    monkeypatch.setattr(agent_loop, "record_failure", lambda *a: faults.append((record(*a), repr(a[3]))) or faults[-1][0])
    run_prompt(worker, sample())
    assert store["puts"] == [] and store["status"] == [("u1", "running"), ("u1", "failure")]
    assert faults[0][0] == "infra" and "generate_timeout_s=0.3" in faults[0][1]


def test_trees_are_seeded_from_step_and_index_not_from_uid(tiny_verl_config, settings_file, monkeypatch):
    settings_file()
    worker, server, _ = make_worker(tiny_verl_config, monkeypatch)
    run_prompt(worker, sample("first-uid", 7, step=3))
    run_prompt(worker, sample("resumed-uid", 7, step=3))   # a resumed step: new uid, same step and index
    run_prompt(worker, sample("next-step", 7, step=4))
    seeds = [p["seed"] for p in server.params]
    per_run = len(seeds) // 3
    assert seeds[:per_run] == seeds[per_run:2 * per_run] and seeds[:per_run] != seeds[2 * per_run:]


def test_tree_agent_loop_refuses_verls_single_trajectory_run():
    from stages.rl.verl.agent_loop import ArpoTreeAgentLoop

    loop = object.__new__(ArpoTreeAgentLoop)
    with pytest.raises(TypeError, match="agent_loop_manager_class"):
        asyncio.run(loop.run({}))
