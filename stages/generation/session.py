"""The rollout side of a stage that samples in-process: the generation backend over a torch model, the toolbox,
prompts, and the driver (the agent runtime's ToolRollout; RL passes its TreeRollout, which branches).

The transformers backend samples from the trainer's own model object (weights updated in place between steps);
the vLLM backend copies the weights into its engine at the start of every rollout (`refresh_weights`).
Each call builds a rollout seeded from the given seed, so a resumed run samples exactly what an uninterrupted
one would have.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from stages.agent.toolbox import corpus_path
from stages.core.config.agent import AgentSection
from stages.core.config.generation import GenerationSettings
from stages.core.refs import DatasetRef
from stages.generation import load_backend
from stages.generation.prompt_items import PromptRow, build_prompt_items
from stages.generation.token_entropy import TokenEntropy
from stages.generation.tool_rollout import ToolRollout
from stages.generation.types import RolloutBatch


def backend_options(cfg: GenerationSettings, model: torch.nn.Module, seed: int) -> dict[str, Any]:
    """Keyword options of `load_backend` for the configured backend (both compute the same per-token entropy)."""
    entropy = TokenEntropy(cfg.entropy_quantity, cfg.entropy_topk)
    if cfg.backend == "vllm":
        # the vLLM engine holds the trainer's dtype, so its sampling log-probs are the ones the trainer recomputes
        return {"model_path": getattr(model.config, "_name_or_path", None), "seed": seed, "entropy": entropy,
                "max_model_len": cfg.max_prompt_length + cfg.max_response_length,
                "engine_kwargs": {"dtype": str(model.dtype).removeprefix("torch.")}}
    return {"kv_reuse": cfg.kv_reuse, "entropy": entropy}


# (backend, toolbox, tokenizer, seed) -> the driver of one rollout call; RL's makes a TreeRollout
RolloutFactory = Callable[[Any, Any, Any, int], ToolRollout]


class RolloutSession:
    def __init__(self, cfg: GenerationSettings, agent: AgentSection, model: torch.nn.Module, tokenizer: Any,
                 data: DatasetRef, cache_root: Path, seed: int = 0, toolbox: Any = None,
                 make_rollout: RolloutFactory | None = None) -> None:
        self.cfg, self.tokenizer, self.make_rollout = cfg, tokenizer, make_rollout
        self.backend = load_backend(cfg.backend, model, tokenizer, **backend_options(cfg, model, seed))
        if toolbox is None:
            from stages.agent.toolbox import ToolBox

            toolbox = ToolBox.from_config(agent, corpus_path(agent, data), str(cache_root))
        self.toolbox = toolbox

    def rollout(self, rows: Sequence[PromptRow], seed: int) -> RolloutBatch:
        prompts = build_prompt_items(rows, self.tokenizer, self.cfg.max_prompt_length, self.cfg.prompt_overflow)
        return self.new_rollout(seed).rollout(prompts)

    def new_rollout(self, seed: int) -> ToolRollout:
        """The driver of one rollout call, seeded by `seed`: `make_rollout`'s, else n independent roots."""
        if self.make_rollout is not None:
            return self.make_rollout(self.backend, self.toolbox, self.tokenizer, seed)
        return ToolRollout(self.backend, self.toolbox, self.tokenizer, self.cfg, seed=seed, show_progress=False)

    def close(self) -> None:
        self.backend.release()
        shutdown = getattr(self.backend, "close", None)  # an engine with its own memory (vLLM) shuts down
        if callable(shutdown):
            shutdown()
        close = getattr(self.toolbox, "close", None)
        if callable(close):
            close()
