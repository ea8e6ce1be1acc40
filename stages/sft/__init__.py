"""Cold-start SFT with LLaMA-Factory: trajectory data, config builder, runner, optional self-critic DPO."""
