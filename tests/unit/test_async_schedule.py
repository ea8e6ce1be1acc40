"""The `async` schedule through the local engine's driver (TreeRollout): the same trees as `rounds` run with the same
counter-based seeds, bit for bit, for GRPO, ARPO and AEPO under both entropy windows; groups really move at their own
pace; and against today's stream-seeded `rounds` the trees keep their distribution.

The scripted backend's segment is a function of the context and the request's sampling seed (so a seed that moved
would change the tree), and it answers every call's requests last first; the toolbox's result counts the calls its
trajectory's CallState holds (a copy that saw its parent's later call would read a different result).
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from stages.generation.base import request_seed
from stages.generation.prompt_items import PromptItem
from stages.rl.rollout import TreeRollout
from tests.unit.test_rl_rollout_fakes import EOS, ScriptedBackend, ToyTokenizer
from tests.unit.test_rollout_schedule import CASES, CountingToolBox, section, snapshot

WAIT_S = 30.0  # ceiling of a wait for the other group (never reached when it works)


def seeded_policy(ctx: str, seed: int, key=None) -> tuple[str, float]:
    """Up to three searches, then an answer; how many, the queries and the entropies follow the request's seed.
    The query names the group (`g<k>`, read off the prompt) and the trajectory (`t<key>`)."""
    group = ctx.split("question ")[1][0]
    salt = int(np.random.default_rng(seed).integers(1000))
    if ctx.count("</result>") >= 1 + salt % 3:
        return "<answer>A</answer>" + EOS, 0.1 + (salt % 5) / 10
    return f"<search>g{group}t{key}q{salt % 4}</search>", 0.05 * (salt % 7)


@dataclasses.dataclass
class SeededBackend(ScriptedBackend):
    """ScriptedBackend whose segment follows each request's own sampling seed (its counter seed, or the call's seed
    plus its index); answers a call's requests last first (`generate_iter`). `seen(group, results)` is set when a
    request of that group with that many tool results in its context was generated."""

    batches: list[list] = dataclasses.field(default_factory=list)   # each call's request keys
    progressed: dict[tuple[str, int], threading.Event] = dataclasses.field(default_factory=dict)

    def generate(self, requests, sampling, seed=None):
        self.batches.append([r.key for r in requests])
        out = []
        for i, req in enumerate(requests):
            s = request_seed(req, seed, i)
            self.policy = lambda ctx, key, s=s: seeded_policy(ctx, s, key)
            out += super().generate([req], sampling, seed)
            ctx = self.tokenizer.decode(req.token_ids)
            self.seen(ctx.split("question ")[1][0], ctx.count("</result>")).set()
            self.seen(f"key {req.key}", ctx.count("</result>")).set()
        return out

    def generate_iter(self, requests, sampling, seed=None):
        results = self.generate(requests, sampling, seed)
        yield from ((i, results[i]) for i in reversed(range(len(results))))

    def seen(self, group: str, results: int) -> threading.Event:
        return self.progressed.setdefault((group, results), threading.Event())


class HeldToolBox(CountingToolBox):
    """Holds the calls whose query starts with `held` until `until` (a tag of SeededBackend.seen) has generated a
    segment after a tool result (`overtaken`: whether it did before the ceiling): only a schedule where that one
    does not wait for the held call gets there."""

    def __init__(self, backend: SeededBackend, held: str = "g0", until: str = "1") -> None:
        super().__init__()
        self.backend, self.overtaken, self.held, self.until = backend, [], held, until

    def execute_many(self, calls):
        if any(c.argument.startswith(self.held) for c, _ in calls):
            self.overtaken.append(self.backend.seen(self.until, 1).wait(WAIT_S))
        return super().execute_many(calls)


def rollout(schedule: str, algorithm: str, cfg, seed: int, seeding: str | None = "counter",
            held: tuple[str, str] | None = None, groups: int = 3):
    tok = ToyTokenizer()
    backend = SeededBackend(tok, seeded_policy)
    box = HeldToolBox(backend, *held) if held else CountingToolBox()
    driver = TreeRollout(backend, box, tok, cfg.model_copy(update={"schedule": schedule}), algorithm, seed=seed,
                         show_progress=False, seeding=seeding if schedule != "async" else None)
    prompts = [PromptItem(g, tok.encode(f"user: question {g}\nassistant:"), f"question {g}", "A", "qa")
               for g in range(groups)]
    return driver.rollout(prompts), backend, box


@pytest.mark.parametrize("window", ["reference", "paper"])
@pytest.mark.parametrize("algorithm,extra", CASES, ids=[c[0] for c in CASES])
def test_async_gives_the_trees_of_rounds_with_counter_seeds(algorithm, extra, window):
    branched = 0
    for seed in range(4):
        cfg = section(window, **extra)
        rounds, _, _ = rollout("rounds", algorithm, cfg, seed)
        run, backend, _ = rollout("async", algorithm, cfg, seed)
        early, _, _ = rollout("early_tools", algorithm, cfg, seed)
        assert snapshot(run) == snapshot(rounds) == snapshot(early)
        assert run.metrics["tool_calls"] == rounds.metrics["tool_calls"] > 0
        assert run.metrics["rounds"] == rounds.metrics["rounds"]
        branched += sum(g.branches for g in rounds.groups)
    assert (branched > 0) == (algorithm != "grpo")     # the trees did branch: the comparison covers forks


def test_a_group_runs_ahead_of_a_group_whose_tools_are_slow():
    """Every first segment is a search; group 0's calls are held until group 1 has generated after a result: async
    gets there (group 1's round closes without group 0's), and the trees are still those of rounds."""
    cfg = section("reference", n=2, initial_rollouts=2, call_limit=3)
    run, backend, box = rollout("async", "grpo", cfg, 0, held=("g0", "1"), groups=2)
    assert box.overtaken and all(box.overtaken)
    alone = [keys for keys in backend.batches if {key // 2 for key in keys} == {1}]
    assert alone, "group 1 never generated on its own while group 0 waited for its tools"
    rounds, _, _ = rollout("rounds", "grpo", cfg, 0, groups=2)
    assert snapshot(run) == snapshot(rounds)


@pytest.mark.parametrize("window", ["reference", "paper"])
def test_a_trajectory_runs_ahead_of_its_siblings(window):
    """Every first segment is a search; trajectory 0's calls are held until its sibling 1 has generated after a
    result: under async trajectory 1 does not wait for its group's round to close, and the trees (forks from
    snapshots at the round's boundary, whatever the parent did since) are still those of rounds."""
    cfg = section(window, n=4, initial_rollouts=2, beam_size=2, branch_probability=0.9, call_limit=3)
    branched = 0
    for seed in range(3):
        run, backend, box = rollout("async", "arpo", cfg, seed, held=("g0t0", "key 1"), groups=1)
        assert box.overtaken and all(box.overtaken)
        rounds, _, _ = rollout("rounds", "arpo", cfg, seed, groups=1)
        assert snapshot(run) == snapshot(rounds)
        branched += sum(g.branches for g in rounds.groups)
    assert branched > 0


def test_counter_seeds_do_not_depend_on_the_batch():
    """The same rollout twice is the same; a different tree seed gives different trees; `rounds` with counter
    seeds differs from stream seeds only in which draw lands where (checked in distribution below)."""
    cfg = section("reference", branch_probability=0.5)
    a, _, _ = rollout("async", "arpo", cfg, 7)
    b, _, _ = rollout("async", "arpo", cfg, 7)
    c, _, _ = rollout("async", "arpo", cfg, 8)
    assert snapshot(a) == snapshot(b) and snapshot(a) != snapshot(c)


def test_async_keeps_the_distribution_of_stream_seeded_rounds():
    """Over 150 tree seeds: mean response tokens per trajectory, tool calls per trajectory and forks per group of
    async (counter seeds) and of today's rounds (stream seeds) agree within 4 standard errors of their difference."""
    cfg = section("reference", branch_probability=0.5)

    def stats(schedule, seeding):
        rows = []
        for seed in range(150):
            batch, _, _ = rollout(schedule, "arpo", cfg, seed, seeding=seeding)
            rows.append([batch.metrics["response_tokens_per_traj"], batch.metrics["tool_calls_per_traj"],
                         batch.metrics["branches"] / batch.metrics["groups"]])
        return np.array(rows)

    stream, counter = stats("rounds", "stream"), stats("async", None)
    se = np.sqrt(stream.var(axis=0, ddof=1) / len(stream) + counter.var(axis=0, ddof=1) / len(counter))
    assert (se > 0).all()
    assert (np.abs(stream.mean(axis=0) - counter.mean(axis=0)) < 4 * se).all(), (stream.mean(0), counter.mean(0), se)
    assert (stream != counter).any()   # the realised trees did change


def test_async_refuses_stream_seeds():
    from stages.generation.tool_rollout import ToolRollout

    tok = ToyTokenizer()
    with pytest.raises(ValueError, match="async schedule needs counter seeds"):
        ToolRollout(SeededBackend(tok, seeded_policy), CountingToolBox(), tok, section("paper").generation(),
                    schedule="async", seeding="stream")


def test_a_row_with_its_own_generator_samples_as_it_would_alone():
    """The transformers backend's counter seeds: with one generator per row (requests with their own seeds), each
    row draws what it draws sampled alone with that seed, whatever rides beside it; vLLM and verl's server take the
    request's seed as its SamplingParams seed."""
    import torch

    from stages.generation.base import GenRequest, SamplingSpec
    from stages.generation.sampling import sample_tokens

    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    spec = SamplingSpec(temperature=1.0)
    gens = lambda seeds: [torch.Generator().manual_seed(s) for s in seeds]
    together = [sample_tokens(logits, spec, gens([11, 12, 13]))[0].tolist() for _ in range(2)]
    alone = [sample_tokens(logits[b:b + 1], spec, gens([s]))[0].item() for b, s in enumerate([11, 12, 13])]
    swapped = sample_tokens(logits.flip(0), spec, gens([13, 12, 11]))[0].tolist()
    assert together[0] == together[1] == alone == swapped[::-1]
    request = GenRequest("k", [1], 4, seed=99)
    assert request_seed(request, 5, 2) == 99 and request_seed(GenRequest("k", [1], 4), 5, 2) == 7
    assert request_seed(GenRequest("k", [1], 4), None, 2) is None


def test_transformers_backend_samples_each_request_from_its_own_seed():
    """Requests carrying seeds: the call's seed no longer matters, a request's own seed does (tiny random Llama,
    rows finishing at different lengths so the per-row generators follow the shrinking batch)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from stages.generation.base import GenRequest, SamplingSpec
    from stages.generation.hf import TransformersBackend

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation="sdpa")
    backend = TransformersBackend(LlamaForCausalLM(config).eval(), ToyTokenizer(), kv_reuse=False)
    spec = SamplingSpec(temperature=1.0)
    ask = lambda seeds: [GenRequest(k, [1, 20 + k, 30], 3 + 3 * k, seed=s) for k, s in enumerate(seeds)]
    ids = lambda results: [r.token_ids for r in results]
    first = ids(backend.generate(ask([5, 9]), spec, seed=1))
    assert ids(backend.generate(ask([5, 9]), spec, seed=2)) == first
    other = ids(backend.generate(ask([6, 10]), spec, seed=1))
    assert other[1] != first[1]
