"""One prompt's rollout tree over verl's LLM-server API, with our unchanged TreeRollout (no verl import here).

verl's agent loops are coroutines on a Ray actor's event loop; our TreeRollout is synchronous. The tree runs in
a worker thread; `ServerBackend.generate` submits each round's requests to the event loop
(`asyncio.run_coroutine_threadsafe`) and waits for them, so a round's generations run concurrently on the server;
`generate_iter` hands them over as they finish (rl.rollout.schedule `early_tools` starts each tool call there).
Every request of one tree carries the same request id: verl's load balancer routes by request id, so all roots,
branches and rounds hit one vLLM replica and its prefix cache serves the shared prompt and branch prefixes (the
role `fork` / `prefill` play in our transformers backend; here they are no-ops, as in our vLLM backend).

No request waits forever: a round's requests get `rl.rollout.generate_timeout_s` from their submission (they run
concurrently); past it the unanswered ones are cancelled and `GenerateTimeout` (a TimeoutError: an infrastructure
fault, stages/rl/verl/failures.py) ends the tree, which the agent-loop worker drops and counts.

verl's server reports only the sampled ids, their log-probs and 'completed' / 'aborted', so the finish reason is
read off the ids: EOS when the last id is an EOS id, `stop` when a stop tag ends the decoded tail, else `length`.

Entropy for branching is the rollout's quantity (`rl.rollout.entropy_quantity`, stages/generation/token_entropy.py):
`surprisal` = -log p(sampled) / ln|V| from the stock server (its expectation under the sampling distribution is the
entropy, so a window mean is an unbiased, noisier estimate); `topk` = the exact truncated top-k entropy computed by
our vLLM server replica (stages/rl/verl/topk_server.py) and returned in `TokenOutput.extra_fields["arpo_entropies"]`,
the same quantity as the local engine's backends; `full` needs the whole distribution, which no server returns.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Executor, as_completed
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from stages.agent.stops import StopMatcher
from stages.core.config.agent import AgentSection
from stages.core.config.rl import RolloutSection
from stages.core.fingerprint import hash_value
from stages.core.rl_parquet import RLRow
from stages.generation.base import (
    AnswersOneByOne,
    ForwardStats,
    GenRequest,
    GenResult,
    PrefixCached,
    SamplingSpec,
    eos_ids_of,
    request_seed,
    vllm_sampling_params,
)
from stages.generation.generate_watch import GenerateTimeout
from stages.generation.prompt_items import build_prompt_items
from stages.generation.token_entropy import TokenEntropy
from stages.generation.types import RolloutBatch
from stages.rl.rollout import TreeRollout
from stages.rl.tree_record import TREE_FIELD, trajectory_record
from stages.rl.verl.settings import PluginSettings

ENTROPY_FIELD = "arpo_entropies"   # per-token top-k entropy (nats) from our server replica
TOPK_FIELD = "arpo_entropy_topk"   # sampling param asking our replica for it

GenerateFn = Callable[..., Awaitable[Any]]  # LLMServerClient.generate(request_id, *, prompt_ids, sampling_params)
VALIDATION_ALGORITHM = "grpo"  # validation trees: val n independent greedy samples, whatever the training algorithm


def server_sampling_params(sampling: SamplingSpec, max_new_tokens: int, seed: int | None,
                           entropy: TokenEntropy) -> dict[str, Any]:
    """Sampling params for verl's `generate`: passed to vLLM's SamplingParams (`logprobs` is turned into 0 =
    the sampled token's log-prob by verl's server); `topk` asks our server replica for its entropies."""
    params = {**vllm_sampling_params(sampling, max_new_tokens, seed), "logprobs": True, "repetition_penalty": 1.0}
    if entropy.quantity == "topk":
        params[TOPK_FIELD] = int(entropy.k)
    return params


def result_from_token_output(output: Any, stopper: StopMatcher, eos_ids: frozenset[int], vocab_size: int,
                             entropy: TokenEntropy) -> GenResult:
    """A verl `TokenOutput` (token_ids, log_probs, stop_reason, extra_fields) as our GenResult."""
    if output.stop_reason == "aborted":
        raise RuntimeError("verl aborted a generate request of the rollout tree (partial rollout / weight sync); "
                           "the arpo_tree agent loop needs trainer.v1.trainer_mode sync or arpo_sync")
    ids = [int(t) for t in output.token_ids]
    if output.log_probs is None or len(output.log_probs) != len(ids):
        raise RuntimeError("verl's server returned no per-token log-probs; set "
                           "actor_rollout_ref.rollout.calculate_log_probs=true (the mapping does)")
    logps = [float(x) for x in output.log_probs]
    if entropy.quantity == "topk":
        nats = (output.extra_fields or {}).get(ENTROPY_FIELD)
        if nats is None or len(nats) != len(ids):
            raise RuntimeError(f"rl.rollout.entropy_quantity=topk but the server returned no '{ENTROPY_FIELD}'; the "
                               "top-k replica (stages/rl/verl/topk_server.py) is not serving; check the plugin log")
        ents = [float(h) / math.log(vocab_size) for h in nats]
    else:
        ents = entropy.from_sampled(logps, vocab_size)
    if ids and ids[-1] in eos_ids:
        return GenResult(ids, logps, ents, "eos")
    stop = stopper.match(ids)
    return GenResult(ids, logps, ents, "stop", stop) if stop else GenResult(ids, logps, ents, "length")


class ServerBackend(AnswersOneByOne, PrefixCached):
    """GenerationBackend over verl's `LLMServerClient.generate`, called from a thread beside the event loop."""

    name = "verl-server"
    enforces_timeout = True   # its requests' own limit (the driver's GenerateWatch is not needed)

    def __init__(self, generate: GenerateFn, loop: asyncio.AbstractEventLoop, request_id: str, tokenizer,
                 eos_token_ids: frozenset[int], entropy: TokenEntropy | None = None,
                 timeout_s: float | None = None) -> None:
        self._generate, self._loop, self.request_id = generate, loop, request_id
        self.timeout_s = timeout_s
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self.entropy = entropy or TokenEntropy("surprisal")
        self.vocab_size = len(tokenizer)
        self.stats = ForwardStats()
        self.weight_versions: list[int] = []  # verl's `global_steps` of the weights that served each request

    def refresh_weights(self) -> None:
        """No-op: verl syncs the trainer's weights into its servers before each step's rollouts."""

    def generate_iter(self, requests: Sequence[GenRequest], sampling: SamplingSpec,
                      seed: int | None = None) -> Iterator[tuple[int, GenResult]]:
        """(index, result) of each request as the server answers it (the `early_tools` schedule starts a call's
        tool there); all requests run concurrently, within timeout_s of their submission."""
        stopper = StopMatcher(self.tokenizer, tuple(sampling.stop))
        futures = [asyncio.run_coroutine_threadsafe(self._generate(
            self.request_id, prompt_ids=list(r.token_ids), sampling_params=server_sampling_params(
                sampling, r.max_new_tokens, request_seed(r, seed, i), self.entropy)),
            self._loop) for i, r in enumerate(requests)]
        index, answered = {future: i for i, future in enumerate(futures)}, 0
        try:
            for future in as_completed(futures, timeout=self.timeout_s):
                i, output = index[future], future.result()
                res = result_from_token_output(output, stopper, self.eos_token_ids, self.vocab_size, self.entropy)
                cached = int((output.extra_fields or {}).get("num_cached_tokens") or 0)
                if (output.extra_fields or {}).get("global_steps") is not None:
                    self.weight_versions.append(int(output.extra_fields["global_steps"]))
                self.stats.add_request(len(requests[i].token_ids), cached, len(res.token_ids))
                answered += 1
                yield i, res
        except FutureTimeout:
            for pending in futures:
                pending.cancel()   # cancels the coroutine on the event loop (verl's client aborts it)
            raise GenerateTimeout(
                f"verl's LLM server answered {answered} of {len(requests)} generate requests of tree "
                f"{self.request_id} within rl.rollout.generate_timeout_s={self.timeout_s:g} s") from None
        self.stats.forward_calls += 1


def tree_seed(run_seed: int, global_step: int, index: int, validate: bool = False) -> int:
    """The tree's sampling seed: a function of (run seed, step, dataset index), so a resumed verl run (which
    replays the interrupted step's prompts) regenerates the same trees. verl's per-step `uid` is random."""
    return int(hash_value("verl-tree", run_seed, int(global_step), int(index), bool(validate)), 16) % 2**31


def row_from_sample(sample: dict[str, Any]) -> RLRow:
    """Our RLRow from the dataset fields verl passes an agent loop (`raw_prompt`, `reward_model`, ...)."""
    messages = [dict(m) for m in list(sample["raw_prompt"])]
    pairs = tuple((str(m["role"]), str(m["content"])) for m in messages)
    extra = dict(sample.get("extra_info") or {})
    truth = (sample.get("reward_model") or {}).get("ground_truth")
    question = extra.get("question") or next((c for r, c in pairs if r == "user"), "")
    index = sample.get("index", extra.get("index", 0))
    return RLRow(index=int(index if index is not None else 0), data_source=str(sample.get("data_source") or ""),
                 ability=str(sample.get("ability") or ""), prompt=pairs, ground_truth=str(truth), question=question)


def tree_rollout_section(cfg: RolloutSection, sampling_params: dict[str, Any], validate: bool,
                         val_n: int) -> RolloutSection:
    """The rollout settings of one tree: verl's sampling params (validation: greedy, val n, no AEPO probe; its trees
    grow by VALIDATION_ALGORITHM)."""
    update: dict[str, Any] = {"temperature": float(sampling_params.get("temperature", cfg.temperature)),
                              "top_p": float(sampling_params.get("top_p", cfg.top_p)),
                              "top_k": int(sampling_params.get("top_k", cfg.top_k))}
    if validate:
        update |= {"n": val_n, "initial_rollouts": val_n, "dynamic_rollouts": False}
    return RolloutSection.model_validate({**cfg.model_dump(), **update})


def tree_outputs(batch: RolloutBatch) -> list[dict[str, Any]]:
    """One dict of `AgentLoopOutput` fields per trajectory of a one-prompt batch, in creation order.

    `extra_fields` carries the branch structure (for hard attribution), the finish reason, tool counters, the
    tree's decisions and spans (`arpo_tree`, JSON text: stages/rl/tree_record.py; our trainer mode's dump reads it)
    and the row's ability (verl's reward manager merges extra_fields into `extra_info`, where our reward reads it).
    A trajectory touched by a tool infrastructure failure gets an all-zero `response_mask` (out of verl's loss
    and its aggregation denominators) and `arpo_masked` (out of its group's statistics: advantage.py)."""
    if len(batch.groups) != 1:
        raise ValueError(f"a rollout tree covers one prompt, got {len(batch.groups)} groups")
    group = batch.groups[0]
    index_of = {t.traj_id: i for i, t in enumerate(group.trajectories)}
    generate_s = batch.metrics.get("time_generate_s", 0.0) / max(1, len(group.trajectories))
    tools_s = batch.metrics.get("time_tools_s", 0.0) / max(1, len(group.trajectories))
    # the tree's time split, on every trajectory (the trainer mode reads it from each tree's first row:
    # stages/rl/verl/monitor.py TIME_FIELDS); verl's own AgentLoopMetrics reach no metric we log
    split = {field: float(batch.metrics.get(key, 0.0)) for field, key in (
        ("arpo_time_generate_s", "time_generate_s"), ("arpo_time_tools_s", "time_tools_s"),
        ("arpo_time_tool_queue_s", "time_tool_queue_s"), ("arpo_calls_per_round", "tool_calls_per_round"),
        ("arpo_tools_offered", "tools_offered"))}
    outputs = []
    for i, traj in enumerate(group.trajectories):
        calls = sum(traj.tool_calls.values())
        outputs.append({
            "prompt_ids": list(traj.prompt_ids), "response_ids": list(traj.response_ids),
            "response_mask": [0] * len(traj.loss_mask) if traj.masked else list(traj.loss_mask),
            "response_logprobs": list(traj.sample_logprobs),
            "num_turns": 2 + 2 * calls,
            "metrics": {"generate_sequences": generate_s, "tool_calls": tools_s},
            "extra_fields": {
                "ability": group.ability, "arpo_tree_index": i, "arpo_kind": traj.kind,
                "arpo_parent": index_of.get(traj.parent_id, -1) if traj.parent_id is not None else -1,
                "arpo_fork_at": int(traj.fork_at), "arpo_finish": traj.finish_reason,
                "arpo_tool_calls": calls, "arpo_tool_errors": traj.tool_errors,
                "arpo_calls_by_tool": json.dumps(dict(sorted(traj.tool_calls.items()))),  # tools/<tool>_per_traj
                "arpo_infra_failures": traj.infra_failures - traj.meta.get("inherited_infra_failures", 0),
                "arpo_masked": int(traj.masked),
                "arpo_branches": group.branches, "arpo_fresh": group.fresh,
                TREE_FIELD: json.dumps(trajectory_record(traj, group)),  # the tree's decisions, for the dump
                **split,
            },
        })
    return outputs


def shared_toolbox(settings: PluginSettings):
    """One ToolBox per process (its thread pool, sandbox pool and cache serve every tree of the worker)."""
    return _toolbox(settings.agent.model_dump_json(), settings.corpus_path, settings.cache_root)


@functools.lru_cache(maxsize=2)
def _toolbox(agent_json: str, corpus_path: str | None, cache_root: str):
    from stages.agent.toolbox import ToolBox

    return ToolBox.from_config(AgentSection.model_validate_json(agent_json), corpus_path, cache_root)


async def rollout_tree(generate: GenerateFn, tokenizer, toolbox, settings: PluginSettings, sample: dict[str, Any],
                       sampling_params: dict[str, Any], *, global_step: int, validate: bool, val_n: int,
                       request_id: str, executor: Executor | None = None) -> list[dict[str, Any]]:
    """Run one prompt's tree (exactly n trajectories) and return their AgentLoopOutput fields."""
    cfg = tree_rollout_section(settings.rollout, sampling_params, validate, val_n)
    row = row_from_sample(sample)
    items = build_prompt_items([row], tokenizer, cfg.max_prompt_length, cfg.prompt_overflow,
                               source=f"verl dataset row {row.index}")
    eos = frozenset(settings.eos_token_ids) if settings.eos_token_ids else eos_ids_of(tokenizer)
    backend = ServerBackend(generate, asyncio.get_running_loop(), request_id, tokenizer, eos,
                            TokenEntropy(cfg.entropy_quantity, cfg.entropy_topk), cfg.generate_timeout_s)
    tree = TreeRollout(backend, toolbox, tokenizer, cfg, VALIDATION_ALGORITHM if validate else settings.algorithm,
                       show_progress=False)
    seed = tree_seed(settings.seed, global_step, row.index, validate)
    batch = await asyncio.get_running_loop().run_in_executor(executor, lambda: tree.rollout(items, seed=seed))
    outputs = tree_outputs(batch)
    if backend.weight_versions:  # verl's staleness metrics read them per trajectory (trainer_base._compute_metrics)
        versions = {"min_global_steps": min(backend.weight_versions), "max_global_steps": max(backend.weight_versions)}
        for output in outputs:
            output["extra_fields"] |= versions
    return outputs
