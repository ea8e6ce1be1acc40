"""What the agent runtime's generation (stages.generation) reads of a rollout configuration, and nothing else.

Generation samples for RL, for SFT's self-critic pairs and for the held-out check; each of those has its own
config section and produces these settings (`RolloutSection.generation()`), so stages.generation depends on
this small value, not on RL's section. It is no YAML section: its values, and their defaults, come from the
section that makes it.
"""

from __future__ import annotations

from dataclasses import dataclass

# the rollout default of generate_timeout_s (RolloutSection), which SFT's and the held-out check's samples take too
DEFAULT_GENERATE_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class GenerationSettings:
    """Sampling, budgets and the backend of n tool-using trajectories per prompt (see RolloutSection's fields)."""

    n: int                     # trajectories per prompt
    call_limit: int            # tool calls per trajectory
    temperature: float         # 0 = greedy
    top_p: float
    top_k: int                 # -1 = off
    max_prompt_length: int
    max_response_length: int   # response tokens per trajectory, tool results included
    prompt_overflow: str       # error | truncate_left | skip
    backend: str               # the generation-backend registry's name (transformers | vllm)
    kv_reuse: bool             # transformers backend: keep KV caches across rounds
    entropy_quantity: str      # per-token entropy (stages/generation/token_entropy.py)
    entropy_topk: int
    generate_timeout_s: float | None = None  # a round's generate past this: GenerateTimeout (None = no limit)
