"""RL stage: generation backends, tool rollouts (GRPO/ARPO/AEPO), rewards, advantages, losses, trainer, merge."""
