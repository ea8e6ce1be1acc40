"""Held-out accuracy of a policy, in process (the `heldout` stage): base vs SFT vs RL on one split, and the learning
bench. Separate from stages/eval, which measures a served model over the benchmarks."""

from stages.heldout.stage import evaluate_heldout, heldout_key, heldout_rows, summarize_verdicts

__all__ = ["evaluate_heldout", "heldout_key", "heldout_rows", "summarize_verdicts"]
