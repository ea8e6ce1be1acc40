"""The rollout side of the trainer: the generation backend over the trainer's model, the toolbox, prompts.

The transformers backend samples from the trainer's own model object (weights updated in place between steps);
the vLLM backend copies the weights into its engine at the start of every rollout (`refresh_weights`).
Each step builds a RolloutEngine seeded from (run seed, step), so a resumed run samples exactly what an
uninterrupted one would have.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from stages.core.config.agent import AgentSection
from stages.core.config.rl import RLSection
from stages.core.refs import DatasetRef
from stages.data import RLRow
from stages.generation import load_backend
from stages.generation.token_entropy import TokenEntropy
from stages.generation.prompts import build_prompt_items
from stages.rl.rollout import RolloutEngine
from stages.generation.types import RolloutBatch


def backend_options(cfg: RLSection, model: torch.nn.Module, seed: int) -> dict[str, Any]:
    """Keyword options of `load_backend` for the configured backend (both compute the same per-token entropy)."""
    entropy = TokenEntropy(cfg.rollout.entropy_quantity, cfg.rollout.entropy_topk)
    if cfg.rollout.backend == "vllm":
        # the engine holds the trainer's dtype, so its sampling log-probs are the ones the trainer recomputes
        return {"model_path": getattr(model.config, "_name_or_path", None), "seed": seed, "entropy": entropy,
                "max_model_len": cfg.rollout.max_prompt_length + cfg.rollout.max_response_length,
                "engine_kwargs": {"dtype": str(model.dtype).removeprefix("torch.")}}
    return {"kv_reuse": cfg.rollout.kv_reuse, "entropy": entropy}


def corpus_path(agent: AgentSection, data: DatasetRef) -> str | None:
    """The search corpus: the agent section's explicit path, else the data stage's corpus file."""
    return agent.search.corpus_path or data.files.get("corpus")


class RolloutSession:
    def __init__(self, cfg: RLSection, agent: AgentSection, model: torch.nn.Module, tokenizer: Any,
                 data: DatasetRef, cache_root: Path, seed: int = 0, toolbox: Any = None) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self.backend = load_backend(cfg.rollout.backend, model, tokenizer, **backend_options(cfg, model, seed))
        if toolbox is None:
            from stages.agent.toolbox import ToolBox

            toolbox = ToolBox.from_config(agent, corpus_path(agent, data), str(cache_root))
        self.toolbox = toolbox

    def rollout(self, rows: list[RLRow], seed: int) -> RolloutBatch:
        ro = self.cfg.rollout
        prompts = build_prompt_items(rows, self.tokenizer, ro.max_prompt_length, ro.prompt_overflow)
        engine = RolloutEngine(self.backend, self.toolbox, self.tokenizer, ro, seed=seed, show_progress=False)
        return engine.rollout(prompts)

    def close(self) -> None:
        self.backend.release()
        close = getattr(self.toolbox, "close", None)
        if callable(close):
            close()
