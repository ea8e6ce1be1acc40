"""The `arpo_tree` agent loop and the agent-loop worker/manager that hand its n trajectories to verl as n samples.

verl runs `rollout.n` independent agent loops per prompt (sessions 0..n-1) and treats a list returned by one loop
as segments of ONE episode: the reward of the last segment is copied to all, and GRPO keeps only the last segment
per session (`AgentLoopWorkerTQ._agent_loop_postprocess`, `compute_advantage_for_multi_trajectories`). A tree is
n episodes that share prefixes, so returning it as a list would train on wrong rewards. Instead
`ArpoAgentLoopWorkerTQ._run_prompt` runs one tree per prompt and stores trajectory i as session i
(key `{uid}_{i}_0`): to the rest of verl the tree is n ordinary samples of one GRPO group (uid), each scored by
verl's reward manager with our `compute_score`. Other agent names fall through to verl's own path. The loop itself
refuses verl's one-trajectory `run()` so the stock worker can never train on a tree by accident.
"""

from __future__ import annotations

import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import hydra
import ray
import transfer_queue as tq
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    AgentLoopWorker,
    DictConfigWrap,
    ToolListWrap,
    _agent_loop_registry,
    register,
)
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ, AgentLoopWorkerTQ

from stages.rl.verl.failures import record_failure
from stages.rl.verl.mapping import TREE_AGENT
from stages.rl.verl.settings import load_settings
from stages.rl.verl.tree import rollout_tree, shared_toolbox

logger = logging.getLogger(__name__)
_PRIVATE = ("agent_name", "__rollout_n__", "__do_sample__")


@functools.lru_cache(maxsize=1)
def _executor(threads: int) -> ThreadPoolExecutor:
    """Threads for the synchronous tree loops of one worker process (verl's default executor stays free)."""
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="arpo-tree")


@register(TREE_AGENT)
class ArpoTreeAgentLoop(AgentLoopBase):
    """Our TreeRollout (strategy, branching, tools, budget) for one prompt over verl's LLM server."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        raise TypeError(f"the {TREE_AGENT} agent loop returns a whole tree of n trajectories; it runs only under "
                        "ArpoAgentLoopManagerTQ (+actor_rollout_ref.rollout.agent.agent_loop_manager_class, set by "
                        "stages.rl.verl.mapping). verl's stock worker would run it n times and train on one branch")

    async def run_tree(self, sampling_params: dict[str, Any], *, validate: bool, **sample: Any) -> list[AgentLoopOutput]:
        settings = load_settings()
        fields = await rollout_tree(
            self.server_manager.generate, self.tokenizer, shared_toolbox(settings), settings, sample,
            dict(sampling_params), global_step=int(sample.get("global_steps", 0) or 0), validate=validate,
            val_n=int(self.rollout_config.val_kwargs.n), request_id=str(sample["uid"]),
            executor=_executor(settings.max_concurrent_trees))
        return [AgentLoopOutput(**{k: v for k, v in f.items() if k != "metrics"},
                                metrics=AgentLoopMetrics(**f["metrics"])) for f in fields]


class ArpoAgentLoopWorker(AgentLoopWorkerTQ.__ray_actor_class__):
    """verl's TransferQueue agent-loop worker; prompts of the tree agent become n sessions of one tree."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """AgentLoopWorkerTQ.__init__ without its zero-argument super(): verl's class is reached through the
        @ray.remote wrapper, so Ray ships it to the worker process by value and that super() then fails with
        "super(type, obj): obj must be an instance or subtype of type" (found by the CPU smoke run)."""
        AgentLoopWorker.__init__(self, *args, **kwargs)
        tq.init()
        self.background_tasks = set()

    def _tree_loop(self) -> ArpoTreeAgentLoop:
        return hydra.utils.instantiate(
            config=_agent_loop_registry[TREE_AGENT], trainer_config=DictConfigWrap(config=self.config),
            server_manager=self.llm_client, tokenizer=self.tokenizer, processor=self.processor,
            hf_model_type=self.hf_model_type, dataset_cls=self.dataset_cls,
            data_config=DictConfigWrap(self.config.data), tools=ToolListWrap(self.tools))

    async def _run_prompt(self, prompt: dict, sampling_params: dict, trajectory: dict, trace: bool = False) -> None:
        if prompt.get("agent_name") != TREE_AGENT:
            return await super()._run_prompt(prompt, sampling_params, trajectory, trace)
        uid, validate = prompt["uid"], bool(trajectory["validate"])
        partition = "val" if validate else "train"
        await tq.async_kv_put(key=uid, partition_id=partition, tag={"status": "running"})
        status, stored = "failure", []
        try:
            config = self.config.actor_rollout_ref.rollout
            expected = int(prompt.get("__rollout_n__", config.val_kwargs.n if validate else config.n))
            sample = {k: v for k, v in prompt.items() if k not in _PRIVATE}
            outputs = await self._tree_loop().run_tree(dict(sampling_params), validate=validate, **sample)
            if len(outputs) != expected:
                raise RuntimeError(f"the tree of prompt {uid} has {len(outputs)} trajectories but verl expects "
                                   f"rollout.n={expected}; rl.rollout.n and actor_rollout_ref.rollout.n must agree")
            for session, output in enumerate(outputs):
                await self._agent_loop_postprocess(output, validate, session_id=session, **sample)
                stored.append(f"{uid}_{session}_0")
            status = "finished"
        except Exception as err:  # as verl's worker does: the prompt is marked failed and the step goes on
            fault = record_failure(load_settings().tree_failures_path, uid, validate, err)
            logger.exception("rollout tree of prompt %s failed (%s); its %d stored trajectories are removed", uid,
                             fault, len(stored))
            await discard_partial_tree(stored, partition)
        await tq.async_kv_put(key=uid, partition_id=partition, tag={"status": status})


async def discard_partial_tree(keys: list[str], partition: str) -> None:
    """A tree is trained whole or not at all: verl's sync sampler still hands a failed prompt's stored
    trajectories to the advantage (replay_buffer.py: failed groups stay sampleable), where GRPO statistics and
    hard attribution over part of a tree would be wrong. The failed prompt then yields no rows; the trainer mode
    counts it (`rollout/trees_dropped`)."""
    if keys:
        await tq.async_kv_clear(keys=keys, partition_id=partition)


ArpoAgentLoopWorkerTQ = ray.remote(ArpoAgentLoopWorker)


class ArpoAgentLoopManagerTQ(AgentLoopManagerTQ):
    """verl's TransferQueue agent-loop manager with our worker (selected by agent_loop_manager_class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.agent_loop_workers_class = ArpoAgentLoopWorkerTQ
