"""What an RL run shows whoever watches, on either engine (the local trainer, verl's monitor) and for a finished
folder (stages.rl.stage): the curves, the newest rollout sample and the rollout-tree pages. Plotting and the dumps'
readers are imported when something is published, so importing this module (the RL key's) loads no torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.core import reporter
from stages.core.config.rl import RLSection


def publish_results(cfg: RLSection, folder: Path, history: list[dict[str, Any]], replot: bool = True) -> None:
    """Curves and the newest rollout sample, to whoever watches (refreshed every trainer.report_every steps).
    `replot=False` shows the finished folder's own plot: a complete folder is never written to (its manifest)."""
    if not history:
        return
    from stages.rl.step_metrics import plot_curves, rollout_sample_markdown
    from stages.rl.tree_report import publish_trees

    step = history[-1]["step"]
    png = folder / "curves.png"
    curves = png if not replot and png.is_file() else plot_curves(history, png)
    if curves is not None:  # None: matplotlib is missing (the vLLM environment)
        reporter.image("rl-curves", curves, f"{cfg.algorithm}: reward, accuracy, entropy, tool calls (step {step})")
    if cfg.trainer.dump_rollouts:
        reporter.markdown("rl-rollouts", rollout_sample_markdown(folder / "rollouts"),
                          f"{cfg.algorithm}: sample of the rollouts of step {step}")
    publish_trees(cfg, folder, write=replot)  # a page per dumped step, the trees image (stages/rl/tree_report.py)
