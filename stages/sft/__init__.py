"""Cold-start SFT with LLaMA-Factory: public-format converters, teacher trajectories, result masking, the
config builder, the subprocess runner, LoRA merge, and the optional self-critic DPO stage."""

from stages.sft.dpo import run_dpo
from stages.sft.stage import passthrough, run_sft

__all__ = ["passthrough", "run_dpo", "run_sft"]
