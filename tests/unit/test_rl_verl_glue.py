"""The verl engine's parts that need no verl: engine registry, memory refusal, config mapping, the server backend
of the tree loop, seeds, advantage glue, reward, data conversion, metrics of resumed runs."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from types import SimpleNamespace

import pytest
import torch

from stages.agent.rewards import compute_rewards
from stages.agent.stops import StopMatcher
from stages.core.config.loader import ConfigError, load_config
from stages.core.config.rl import AdvantageSection, RLSection
from stages.core.config.rl_engine import local_engine_problem, params_from_name
from stages.generation.base import GenRequest, SamplingSpec
from stages.generation.token_entropy import TokenEntropy
from stages.rl.advantages import compute_advantages, owner_matrix
from stages.rl.verl.advantage import tree_advantages
from stages.rl.verl.mapping import VerlPaths, verl_overrides
from stages.rl.verl.reward import compute_score
from stages.rl.verl.tree import ServerBackend, result_from_token_output, tree_seed
from tests.unit.test_rl_rollout_fakes import ToyTokenizer

PATHS = VerlPaths(model="/m", train_file="/d/t.parquet", val_file="/d/v.parquet", checkpoints="/o/ck",
                  settings="/o/s.json", agent_loops="/o/a.yaml", rollout_dump="/o/r")


def test_engine_field_names_the_engine_registry():
    from stages.core.registry import find_registry
    from stages.rl.engines import RL_ENGINES

    kind = RLSection.model_fields["engine"].json_schema_extra["registry"]
    assert find_registry(kind) is RL_ENGINES and RL_ENGINES.names() == ["local", "verl"]


@pytest.mark.parametrize("names,billions", [(("Qwen2.5-7B-Instruct",), 7.0), (("Qwen3-14B",), 14.0),
                                            (("SmolLM2-135M-Instruct",), 0.135), ((None, "Qwen/Qwen2.5-1.5B"), 1.5),
                                            (("my-model",), None)])
def test_model_size_from_name(names, billions):
    assert params_from_name(*names) == billions


def test_memory_estimate_and_refusal():
    # 7B x 16 B = 112 GB > 80 GB x (1 - 0.6) = 32 GB left beside vLLM; 1.5B x 16 = 24 GB fits in 32 GB
    problem = local_engine_problem(7.0, 80, "vllm", kl=False)
    assert "~112 GB" in problem and "32 GB" in problem and "rl.engine: verl" in problem
    assert local_engine_problem(1.5, 80, "vllm", kl=False) is None
    assert local_engine_problem(3.0, 80, "transformers", kl=False) is None      # 48 GB, no vLLM
    assert local_engine_problem(3.0, 80, "transformers", kl=True) is None       # + 12 GB reference = 60
    assert local_engine_problem(4.5, 80, "transformers", kl=True) is not None   # 90 GB


def test_a_paper_profile_on_the_local_engine_fails_at_load_naming_verl():
    with pytest.raises(ConfigError, match="rl.engine: verl"):
        load_config("arpo-qwen2.5-7b-reasoning", ["rl.engine=local"])
    assert load_config("arpo-qwen2.5-7b-reasoning").rl.engine == "verl"
    assert load_config("tiny-cpu").rl.engine == "local"


def _as_dict(overrides: list[str]) -> dict[str, str]:
    return dict(o.split("=", 1) for o in overrides)


def test_mapping_values_for_the_aepo_profile():
    cfg = load_config("aepo-qwen3-14b-deepsearch")
    o = _as_dict(verl_overrides(cfg.rl, cfg.model.dtype, 3, PATHS))
    a, r = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    assert o[f"{r}.n"] == "12" and o["data.train_batch_size"] == "64" and o[f"{a}.ppo_mini_batch_size"] == "8"
    assert o["data.max_prompt_length"] == "2000" and o[f"{r}.max_model_len"] == str(2000 + 6192)
    assert o[f"{a}.policy_loss.loss_mode"] == "arpo_aepo_balanced_clip"
    assert o["trainer.v1.trainer_mode"] == "arpo_sync"                      # every algorithm: verl's sync + our advantage
    # the profile's budget: 12288, below the reference's 2 x (2000 + 6192) = 16384, at which the memory model puts
    # the old-log-prob pass at ~90 GiB of an 80 GiB card (docs/plan.md, "Memory")
    assert o[f"{a}.use_dynamic_bsz"] == "true" and o[f"{a}.ppo_max_token_len_per_gpu"] == "12288"
    assert o[f"{r}.gpu_memory_utilization"] == "0.6" and o[f"{r}.tensor_model_parallel_size"] == "1"
    assert o[f"{a}.fsdp_config.dtype"] == "bfloat16" and o[f"{a}.fsdp_config.model_dtype"] == "fp32"
    assert o["trainer.save_freq"] == "5" and o["trainer.resume_mode"] == "auto" and o["data.seed"] == "3"
    assert o[f"{a}.use_kl_loss"] == "false" and o[f"{a}.loss_agg_mode"] == "token-mean"
    assert o["+reward.custom_reward_function.reward_kwargs.reward"] == "reference"
    assert o[f"{a}.optim.betas"] == "[0.9,0.999]"


def test_mapping_options_and_refusals():
    rl = load_config("tiny-cpu", ["rl.loss.kl_coef=0.01", "rl.loss.kl_type=k1",
                                  "rl.loss.aggregation=seq_mean_token_sum_norm", "rl.rollout.prompt_overflow=skip"]).rl
    o = _as_dict(verl_overrides(rl, "float32", 0, VerlPaths(**{**PATHS.__dict__, "model": "/my models/a=b"})))
    a = "actor_rollout_ref.actor"
    assert o[f"{a}.use_kl_loss"] == "true" and o[f"{a}.kl_loss_type"] == "kl" and o[f"{a}.kl_loss_coef"] == "0.01"
    assert o[f"{a}.loss_agg_mode"] == "seq-mean-token-sum-norm"
    assert o[f"{a}.loss_scale_factor"] == str(rl.rollout.max_response_length)
    assert o["data.filter_overlong_prompts"] == "true" and o["trainer.v1.trainer_mode"] == "arpo_sync"
    assert o["actor_rollout_ref.model.path"] == "'/my models/a=b'"            # quoted for hydra
    with pytest.raises(ValueError, match="no verl registration"):
        verl_overrides(rl.model_copy(update={"loss": rl.loss.model_copy(update={"policy_loss": "x"})}), "float32", 0,
                       PATHS)


def _out(ids, logps, stop_reason="completed", extra=None):
    return SimpleNamespace(token_ids=ids, log_probs=logps, stop_reason=stop_reason, extra_fields=extra or {})


SURPRISAL, TOPK = TokenEntropy("surprisal"), TokenEntropy("topk", 10)


def test_token_output_conversion():
    tok = ToyTokenizer()
    stopper = StopMatcher(tok, ("</search>",))
    ln_v = math.log(len(tok))
    search = tok.chars("a</search>")
    res = result_from_token_output(_out(search, [-0.5] * len(search)), stopper, frozenset({0}), len(tok), SURPRISAL)
    assert (res.finish_reason, res.stop) == ("stop", "</search>")
    assert res.entropies == pytest.approx([0.5 / ln_v] * len(search))          # surprisal / ln|V|
    assert result_from_token_output(_out([5, 0], [-1.0, -2.0]), stopper, frozenset({0}), len(tok),
                                    SURPRISAL).finish_reason == "eos"
    assert result_from_token_output(_out([5, 6], [-1.0, -2.0]), stopper, frozenset({0}), len(tok),
                                    SURPRISAL).finish_reason == "length"
    topk = result_from_token_output(_out([5], [-1.0], extra={"arpo_entropies": [2.0]}), stopper, frozenset({0}),
                                    len(tok), TOPK)
    assert topk.entropies == pytest.approx([2.0 / ln_v])
    with pytest.raises(RuntimeError, match="top-k"):
        result_from_token_output(_out([5], [-1.0]), stopper, frozenset({0}), len(tok), TOPK)
    with pytest.raises(RuntimeError, match="aborted"):
        result_from_token_output(_out([], None, "aborted"), stopper, frozenset({0}), len(tok), SURPRISAL)
    with pytest.raises(RuntimeError, match="calculate_log_probs"):
        result_from_token_output(_out([5], None), stopper, frozenset({0}), len(tok), SURPRISAL)


def test_server_backend_submits_a_round_concurrently_under_one_request_id():
    tok = ToyTokenizer()
    calls = []

    async def generate(request_id, *, prompt_ids, sampling_params):
        calls.append((request_id, sampling_params))
        await asyncio.sleep(0.01)
        ids = tok.chars("x")[: sampling_params["max_tokens"]]
        return _out(ids, [-0.1] * len(ids), extra={"num_cached_tokens": 2})

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        backend = ServerBackend(generate, loop, "uid-1", tok, frozenset({0}))
        results = backend.generate([GenRequest("a", [1, 2, 3], 4), GenRequest("b", [1, 2, 3, 4], 4)],
                                   SamplingSpec(1.0, 1.0, -1, ("</search>",)), seed=10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
    assert [r.finish_reason for r in results] == ["length", "length"]
    assert [c[0] for c in calls] == ["uid-1", "uid-1"] and [c[1]["seed"] for c in calls] == [10, 11]
    assert calls[0][1]["stop"] == ["</search>"] and calls[0][1]["include_stop_str_in_output"]
    assert (backend.stats.reused_tokens, backend.stats.prefill_tokens, backend.stats.decode_tokens) == (4, 3, 2)


def test_tree_seed_is_a_function_of_step_and_index():
    assert tree_seed(0, 3, 7) == tree_seed(0, 3, 7)
    assert len({tree_seed(0, 3, 7), tree_seed(0, 4, 7), tree_seed(0, 3, 8), tree_seed(1, 3, 7),
                tree_seed(0, 3, 7, validate=True)}) == 5


def test_tree_advantages_match_ours_in_any_row_order():
    torch.manual_seed(0)
    # two trees of 3: tree index 1 branches off 0 at token 2, tree index 2 is a root; verl rows are shuffled
    uids = ["u", "u", "u", "v", "v", "v"]
    extras = [{"arpo_tree_index": i % 3, "arpo_parent": 0 if i % 3 == 1 else -1, "arpo_fork_at": 2} for i in range(6)]
    mask = torch.ones(6, 5)
    mask[:, 3] = 0
    scores = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0])
    token_rewards = torch.zeros(6, 5)
    token_rewards[:, -1] = scores
    entropy = torch.rand(6, 5)
    cfg = AdvantageSection(attribution="hard", entropy_aware=True)
    owner = owner_matrix([None, 0, None, None, 3, None], [0, 2, 0, 0, 2, 0], 5)
    want = compute_advantages(cfg, scores, torch.tensor([0, 0, 0, 1, 1, 1]), mask, owner, entropy)
    perm = [4, 1, 5, 0, 3, 2]
    got = tree_advantages(cfg, token_rewards[perm], mask[perm], [uids[p] for p in perm], [extras[p] for p in perm],
                          entropy[perm])
    assert torch.allclose(got, want[perm], atol=1e-6)
    soft = tree_advantages(AdvantageSection(), token_rewards, mask, uids)
    assert torch.allclose(soft, compute_advantages(AdvantageSection(), scores, torch.tensor([0, 0, 0, 1, 1, 1]), mask))


@pytest.mark.parametrize("response,ability", [("<think>x</think><answer>\\boxed{42}</answer>", "qa"),
                                              ("no format", "qa"), ("<think>x</think><answer>\\boxed{0.5}</answer>",
                                                                    "math")])
def test_custom_reward_function_is_our_registry(response, ability):
    for name in ("reference", "math_equiv"):
        got = compute_score("src", response, "42" if ability == "qa" else "\\frac{1}{2}", {"ability": ability},
                            reward=name)
        want = compute_rewards(name, [response], ["42" if ability == "qa" else "\\frac{1}{2}"], [ability])[0]
        assert got["score"] == want.score and got["acc"] == float(want.correct) and got["f1"] == want.f1
        assert all(isinstance(v, float) for v in got.values())


def test_verl_parquet_round_trips_through_our_reader(tmp_path):
    from stages.core.rl_parquet import make_row, read_rl_parquet, write_rl_parquet
    from stages.rl.verl.launch import write_verl_parquet

    rows = read_rl_parquet(write_rl_parquet([make_row(i, "s", "qa", "sys", f"q{i}", f"a{i}", "train")
                                             for i in range(3)], tmp_path / "in.parquet"))
    assert read_rl_parquet(write_verl_parquet(rows, tmp_path / "verl.parquet")) == rows


def test_metrics_of_a_resumed_run_keep_one_row_per_step(tmp_path):
    from stages.rl.verl.launch import collect_metrics

    attempts = tmp_path / "verl_metrics"
    attempts.mkdir()
    (attempts / "attempt_1.jsonl").write_text("".join(json.dumps({"step": s, "data": {"arpo/reward/mean": s}}) + "\n"
                                                      for s in (1, 2, 3)))
    (attempts / "attempt_2.jsonl").write_text(json.dumps({"step": 3, "data": {"arpo/reward/mean": 30}}) + "\n")
    history = collect_metrics(tmp_path)                                             # step 3 redone after a crash
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == history == [{"step": 1, "reward/mean": 1.0}, {"step": 2, "reward/mean": 2.0},
                               {"step": 3, "reward/mean": 30.0}]


def test_verl_engine_without_verl_names_the_setup(tmp_path):
    from stages.rl.engines import RL_ENGINES

    cfg = load_config("tiny-cpu", ["rl.engine=verl"])
    with pytest.raises(RuntimeError, match="setup-gpu.sh"):
        RL_ENGINES.get("verl")(cfg.rl, cfg.agent, None, None, tmp_path, tmp_path, 0, "float32")


def test_topk_server_asks_marked_requests_for_k_logprobs_and_returns_their_entropies():
    """Against a server shaped like verl's vLLMHttpServer (builds `self.engine`, turns `logprobs` into 0 and calls
    `engine.generate(prompt=, sampling_params=, request_id=)`): our subclass raises it to k for marked requests."""
    from stages.rl.verl.topk_server import make_topk_server_class

    def lp(value: float, rank: int) -> SimpleNamespace:
        return SimpleNamespace(logprob=value, rank=rank)

    seen: list[int] = []

    class Engine:
        async def generate(self, *, prompt, sampling_params, request_id, **_):
            seen.append(sampling_params.logprobs)
            yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5], logprobs=[{5: lp(-0.1, 1), 6: lp(-2.4, 2)}])])

    class Server:
        def __init__(self) -> None:
            self.engine = Engine()

        async def generate(self, prompt_ids, sampling_params, request_id):
            params = SimpleNamespace(logprobs=0 if sampling_params.pop("logprobs", False) else None)
            async for final in self.engine.generate(prompt=prompt_ids, sampling_params=params,  # noqa: B007
                                                    request_id=request_id):
                pass
            return SimpleNamespace(token_ids=final.outputs[0].token_ids, extra_fields={})

    server = make_topk_server_class(Server)()
    marked = asyncio.run(server.generate([1], {"logprobs": True, "arpo_entropy_topk": 10}, "r1"))
    plain = asyncio.run(server.generate([1], {"logprobs": True}, "r2"))
    # H = -(e^-0.1 * -0.1 + e^-2.4 * -2.4) nats over the two returned entries
    assert marked.extra_fields["arpo_entropies"] == pytest.approx([math.exp(-0.1) * 0.1 + math.exp(-2.4) * 2.4])
    assert "arpo_entropies" not in plain.extra_fields and seen == [10, 0]


def test_run_rl_dispatches_to_the_configured_engine_and_caches_its_checkpoint(tmp_path, monkeypatch):
    from stages.core.refs import CheckpointRef, DatasetRef, ModelRef
    from stages.rl import engines
    from stages.rl.stage import run_rl

    calls = []

    def fake_verl(cfg, agent, policy, data, stage, cache_root, seed, dtype):
        calls.append((stage, seed, dtype))
        actor = stage / "checkpoints" / "global_step_2" / "actor"
        actor.mkdir(parents=True)
        (actor / "model_world_size_1_rank_0.pt").write_bytes(b"shard")
        return CheckpointRef(path=str(actor), fingerprint="", format="verl_fsdp", step=2,
                             meta={"metrics": str(stage / "metrics.jsonl")})

    monkeypatch.setitem(engines.RL_ENGINES._entries, "verl", fake_verl)
    cfg = load_config("tiny-cpu", ["rl.engine=verl"])
    policy = ModelRef(path=str(tmp_path), fingerprint="p", name="m")
    data = DatasetRef(path="d", fingerprint="d", meta={"rl_train_rows": 8})  # 4 steps of tiny-cpu's 2 prompts
    first = run_rl(cfg.rl, cfg.agent, policy, data, tmp_path / "out", tmp_path, seed=1, dtype="bfloat16")
    again = run_rl(cfg.rl, cfg.agent, policy, data, tmp_path / "out", tmp_path, seed=1, dtype="bfloat16")
    assert len(calls) == 1 and calls[0][1:] == (1, "bfloat16")                 # the second call is a cache hit
    assert first == again and first.format == "verl_fsdp" and first.step == 2 and first.base == policy
    assert first.path.endswith("global_step_2/actor") and first.meta["engine"] == "verl"
