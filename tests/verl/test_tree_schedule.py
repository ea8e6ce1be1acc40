"""The `early_tools` schedule through verl's agent-loop worker (our override, a scripted server that answers a
round's requests out of order): the rows stored in TransferQueue equal those of `rounds`, bit for bit, for GRPO,
ARPO and AEPO under both entropy windows."""

from __future__ import annotations

import pytest
import torch

from tests.verl.test_tree_worker import make_worker, run_prompt, sample

pytestmark = pytest.mark.verl
TIMING = ("metrics", "arpo_time_generate_s", "arpo_time_tools_s", "arpo_time_tool_queue_s")  # wall times


def comparable(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items() if k not in TIMING}
    if isinstance(value, list | tuple):
        return [comparable(v) for v in value]
    return value


@pytest.mark.parametrize("window", ["reference", "paper"])
@pytest.mark.parametrize("algorithm", ["grpo", "arpo", "aepo"])
def test_early_tools_stores_the_rows_of_rounds(tiny_verl_config, settings_file, monkeypatch, algorithm, window):
    stored, orders = {}, {}
    for schedule in ("rounds", "early_tools"):
        settings_file(algorithm=algorithm, entropy_window=window, schedule=schedule, branch_probability=0.5,
                      dynamic_rollouts=algorithm == "aepo")
        worker, server, store = make_worker(tiny_verl_config, monkeypatch)
        server.turns = lambda params: 1 + (-params["seed"]) % 5   # later seeds of a round answer first
        answered, generate = [], server.generate

        async def answer_order(request_id, answered=answered, generate=generate, **kw):
            output = await generate(request_id, **kw)
            answered.append(kw["sampling_params"]["seed"])
            return output

        worker.llm_client.generate = answer_order
        for index in range(4):
            run_prompt(worker, sample(uid=f"u{index}", index=index))
        stored[schedule] = ([k for keys, _, _ in store["puts"] for k in keys], comparable(store["rows"]))
        orders[schedule] = answered
        assert store["status"].count(("u3", "finished")) == 1
    assert stored["early_tools"] == stored["rounds"]
    assert orders["early_tools"] != [p["seed"] for p in server.params]   # the answers did come out of order
    rows = stored["rounds"][1]
    kinds = [row["extra_fields"]["arpo_kind"] for row in rows]
    assert len(rows) == 16 and (("branch" in kinds) == (algorithm != "grpo"))


@pytest.mark.parametrize("window", ["reference", "paper"])
@pytest.mark.parametrize("algorithm", ["grpo", "arpo", "aepo"])
def test_async_stores_the_rows_of_rounds_with_counter_seeds(tiny_verl_config, settings_file, monkeypatch, algorithm,
                                                            window):
    """`async` through verl's worker (counter seeds: per-request seeds from (tree seed, trajectory, segment), a
    generator per group) stores the rows `rounds` stores when it runs on the same counter seeds."""
    import functools

    from stages.rl.rollout import TreeRollout
    from stages.rl.verl import tree

    monkeypatch.setattr(tree, "TreeRollout", functools.partial(TreeRollout, seeding="counter"))
    stored = {}
    for schedule in ("rounds", "async"):
        settings_file(algorithm=algorithm, entropy_window=window, schedule=schedule, branch_probability=0.5,
                      dynamic_rollouts=algorithm == "aepo")
        worker, server, store = make_worker(tiny_verl_config, monkeypatch)
        server.turns = lambda params: 1 + (-params["seed"]) % 5
        for index in range(4):
            run_prompt(worker, sample(uid=f"u{index}", index=index))
        stored[schedule] = ([k for keys, _, _ in store["puts"] for k in keys], comparable(store["rows"]))
    assert stored["async"] == stored["rounds"]
    kinds = [row["extra_fields"]["arpo_kind"] for row in stored["rounds"][1]]
    assert len(kinds) == 16 and (("branch" in kinds) == (algorithm != "grpo"))
