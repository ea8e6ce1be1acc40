"""The published training runs the algorithm card compares against: what the reference code does at each paper
setting (facts with file:line in docs/reference.md).

ARPO: RUC-NLPIR/ARPO commit a95cd08, folder ARPO/ (verl 0.3.1.dev fork `verl_arpo_entropy`).
AEPO: RUC-NLPIR/ARPO commit 30efc15 ("Fix #42 when dynamic rollout is disabled"), folder AEPO/ (fork
`verl_aepo_entropy`), read from the public fork wangevan6/ARPO which carries that commit.
GRPO has no published script in either repository: its reference is verl's GRPO as the ARPO 7B reasoning script
configures it, with all n samples drawn from the prompt.
Tool-Star: RUC-NLPIR/Tool-Star commit 8e5936f, Tool_Star_RL/ (a verl 0.2 fork): vanilla GRPO, the run of
`scripts/train/run_tool_star.sh` through `train.sh` on the fork's `ppo_trainer.yaml` (docs/reference.md "Tool-Star's
recipe"); the rest of its recipe (SFT, DPO, evaluation) is stages/core/recipes.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from stages.core.algorithm_spec import ALGORITHMS
from stages.core.registry import Registry

ARPO_CODE = "RUC-NLPIR/ARPO@a95cd08"
AEPO_CODE = "RUC-NLPIR/ARPO@30efc15"
TOOLSTAR_CODE = "RUC-NLPIR/Tool-Star@8e5936f"
NO_DUAL_CLIP = float("inf")   # clip_ratios' c where the reference's loss has no dual clip
DOC = "docs/reference.md"


@dataclass(frozen=True, kw_only=True)
class ReferenceSetting:
    """One published training script and the reference code it runs."""

    name: str
    algorithm: str
    code: str                    # repository@commit of the code
    script: str                  # the launch script (and its hydra config)
    n: int                       # actor_rollout_ref.rollout.n
    initial_rollouts: int
    beam_size: int
    branch_probability: float    # tau
    entropy_weight: float        # w
    branch_penalty: float        # AEPO: factor max(0, 1 - 0.05 c); ARPO: none
    dynamic_rollouts: bool
    call_limit: int
    balanced_clip: bool          # actor.enable_entropy_balanced_clipping
    entropy_advantage_flag: bool  # actor.enable_entropy_balanced_advantage (inert with entropy_coeff = 0)
    entropy_coeff: float = 0.0
    kl_loss_coef: float = 0.0    # use_kl_loss=True, kl_loss_type=low_var_kl, coefficient 0
    clip_ratios: tuple[float, float, float] = (0.2, 0.2, 3.0)
    fork: str = "its verl 0.3.1.dev fork"
    reward_code: str = "deep_research.py compute_score"
    # threads of the tool pool of one rollout worker: ARPO's and AEPO's `tools.max_workers` 64
    # (vllm_rollout_with_tools.py:93, ppo_trainer.yaml / ppo_trainer_dr.yaml:154; docs/reference.md "Tool pool")
    tool_threads: str = "64"


REFERENCE_SETTINGS: Registry[ReferenceSetting] = Registry("reference setting", {s.name: s for s in (
    ReferenceSetting(name="arpo-qwen2.5-7b-reasoning", algorithm="arpo", code=ARPO_CODE,
                     script="ARPO/scripts/ARPO_7B_Reasoning_1node.sh (config ppo_trainer.yaml)", n=16,
                     initial_rollouts=8, beam_size=2, branch_probability=0.5, entropy_weight=0.2, branch_penalty=0.0,
                     dynamic_rollouts=False, call_limit=3, balanced_clip=False, entropy_advantage_flag=False),
    ReferenceSetting(name="arpo-qwen3-14b-deepsearch", algorithm="arpo", code=ARPO_CODE,
                     script="ARPO/scripts/ARPO_14b_Deepsearch_1node.sh (config ppo_trainer_dr.yaml)", n=12,
                     initial_rollouts=6, beam_size=2, branch_probability=0.5, entropy_weight=0.2, branch_penalty=0.0,
                     dynamic_rollouts=False, call_limit=6, balanced_clip=False, entropy_advantage_flag=False),
    ReferenceSetting(name="aepo-qwen3-14b-deepsearch", algorithm="aepo", code=AEPO_CODE,
                     script="AEPO/scripts/AEPO_Qwen3_14B_DeepResearch.sh (config ppo_trainer_dr.yaml)", n=12,
                     initial_rollouts=6, beam_size=2, branch_probability=0.5, entropy_weight=0.2, branch_penalty=0.05,
                     dynamic_rollouts=False, call_limit=6, balanced_clip=True, entropy_advantage_flag=True),
    ReferenceSetting(name="grpo-qwen2.5-7b-reasoning", algorithm="grpo", code=ARPO_CODE,
                     script="no published GRPO script: ARPO_7B_Reasoning_1node.sh's settings, n samples from the prompt",
                     n=16, initial_rollouts=16, beam_size=1, branch_probability=0.5, entropy_weight=0.2,
                     branch_penalty=0.0, dynamic_rollouts=False, call_limit=3, balanced_clip=False,
                     entropy_advantage_flag=False),
    # entropy_coeff 0.001 and clip_ratio 0.2 from the fork's ppo_trainer.yaml (32-33), which train.sh leaves; its
    # compute_policy_loss (core_algos.py 227-258) has no dual clip; use_kl_loss=True with coefficient 0 (91-93)
    ReferenceSetting(name="grpo-toolstar-qwen2.5-3b", algorithm="grpo", code=TOOLSTAR_CODE,
                     script="Tool_Star_RL/scripts/train/run_tool_star.sh -> train.sh "
                            "(config verl/trainer/config/ppo_trainer.yaml)",
                     n=8, initial_rollouts=8, beam_size=1, branch_probability=0.5, entropy_weight=0.2,
                     branch_penalty=0.0, dynamic_rollouts=False, call_limit=3, balanced_clip=False,
                     entropy_advantage_flag=False, entropy_coeff=0.001, clip_ratios=(0.2, 0.2, NO_DUAL_CLIP),
                     fork="its verl 0.2 fork (Tool_Star_RL/src/verl)",
                     reward_code="re_search.py compute_score (Tool_Star_RL/src/verl/verl/utils/reward_score)"),
)})
def reference_for(algorithm: str, name: str | None = None) -> ReferenceSetting:
    """The setting `name` (rl.reference_setting), else the algorithm's published run (its spec's `reference`)."""
    return REFERENCE_SETTINGS.get(name or ALGORITHMS.get(algorithm).reference)
