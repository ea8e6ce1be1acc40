"""The rollout trees of an RL stage folder, for whoever looks: one HTML page per dumped step
(`trees/step_<k>.html`, stages/rl/tree_page.py), an image of the newest step's first groups and a markdown artifact
linking the pages (`publish_trees`, every rl.trainer.report_every steps and at the end, both engines), and the
text of `arpo trees` (`trees_report`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stages.core import reporter
from stages.core.atomic import save_figure
from stages.core.errors import BadInputError, MissingInputError
from stages.core.log import get_logger
from stages.rl.tree_page import lanes, write_page
from stages.rl.trees import (
    STAT_LABELS,
    TreeGroup,
    dump_files,
    format_stat,
    read_step,
    render_group,
    step_stats,
)

log = get_logger(__name__)
PAGES = "trees"        # the stage folder's page folder
IMAGE_GROUPS = 4       # groups drawn in the artifact image


def page_path(stage: Path, step: int) -> Path:
    return Path(stage) / PAGES / f"step_{step:06d}.html"


def write_pages(stage: Path) -> dict[int, Path]:
    """A page for every dump without an up-to-date one (a redone step rewrites its dump); step -> page."""
    pages = {}
    for step, dump in dump_files(Path(stage) / "rollouts").items():
        page = page_path(stage, step)
        if not page.is_file() or page.stat().st_mtime < dump.stat().st_mtime:
            groups = read_step(dump)
            write_page(page, f"Rollout trees, step {step}", str(dump), groups, step_stats(groups))
        pages[step] = page
    return pages


def finish_pages(cfg: Any, stage: Path) -> None:
    """The pages of every dump, however the run ends (an alarm that stops it is when its trees matter most); logs,
    never raises."""
    if cfg.trainer.dump_rollouts:
        try:
            write_pages(stage)
        except (BadInputError, ValueError, KeyError, TypeError, OSError) as err:
            log.warning("rollout trees of %s not written: %s", stage, err)


def publish_trees(cfg: Any, stage: Path, write: bool = True) -> None:
    """Pages, the newest step's image (`rl-trees`) and the page list with that step's statistics
    (`rl-tree-pages`). `write=False` publishes what a finished folder holds (it is never written to)."""
    if not cfg.trainer.dump_rollouts:
        return
    dumps = dump_files(Path(stage) / "rollouts")
    if not dumps:
        return
    try:
        pages = write_pages(stage) if write else {s: page_path(stage, s) for s in dumps if page_path(stage, s).is_file()}
        step = max(dumps)
        groups = read_step(dumps[step])
        png = Path(stage) / PAGES / f"step_{step:06d}.png"
        if write:
            png = plot_trees(groups[:IMAGE_GROUPS], png, f"{cfg.algorithm}, step {step}") or png
    except (BadInputError, ValueError, KeyError, TypeError, OSError) as err:  # watching never stops a run
        log.warning("rollout trees of %s not written: %s", stage, err)
        return
    if png.is_file():
        reporter.image("rl-trees", png, f"{cfg.algorithm}: rollout trees of the first groups of step {step} "
                       f"(every group: {page_path(stage, step)})")
    reporter.markdown("rl-tree-pages", pages_markdown(stage, pages, step, step_stats(groups)),
                      f"{cfg.algorithm}: rollout tree pages (open from disk) and step {step}'s tree statistics")


def pages_markdown(stage: Path, pages: dict[int, Path], step: int, stats: dict[str, float | None]) -> str:
    rows = "\n".join(f"| {label} | {format_stat(key, stats.get(key))} |" for key, label, _ in STAT_LABELS)
    listed = "\n".join(f"- step {s}: [{p.name}]({p.resolve().as_uri()}) `{p.resolve()}`"
                       for s, p in sorted(pages.items(), reverse=True)[:20])
    return (f"### Rollout trees\nOne self-contained page per step: open it from disk (a browser may refuse a file link "
            f"from this page: copy the path). In a terminal: `arpo trees {Path(stage).resolve()} --step {step}`.\n\n"
            f"{listed}\n\n#### Step {step}\n| statistic | value |\n|---|---|\n{rows}\n")


def plot_trees(groups: list[TreeGroup], png: Path, title: str) -> Path | None:
    """The lanes of the first groups (as on the page) with matplotlib; None without it (the vLLM environment)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not groups:
        return None
    heights = [max(1, len(lanes(g))) for g in groups]
    fig, axes = plt.subplots(len(groups), 1, figsize=(11, 0.9 + 0.36 * sum(heights) + 0.5 * len(groups)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    colors = {"model": "#4a7fd0", "tool": "#f0a030", "env": "#bbbbbb", "text": "#4a7fd0"}
    for ax, g in zip(axes[:, 0], groups):
        order = lanes(g)
        lane = {n.traj_id: i for i, n in enumerate(order)}
        span = max([n.length for n in order] + [1])
        for n in order:
            yn = lane[n.traj_id]
            for p in n.pieces():
                ax.plot([p.start, p.end], [yn, yn], color=colors.get(p.kind, "#888"), lw=5, solid_capstyle="butt")
            for c in n.children:
                ax.plot([c.fork_at, c.fork_at], [yn, lane[c.traj_id]], color="#888", lw=1)
                ax.plot([c.fork_at], [yn], "o", color="#111111", ms=5)
            ax.text(n.length + span * 0.01, yn, f"r {n.reward:+.2f} A {n.advantage:+.2f}", va="center", fontsize=7)
        ax.set_yticks(range(len(order)), [f"#{n.traj_id} {n.row.get('kind', '')}" for n in order], fontsize=7)
        ax.set_ylim(len(order) - 0.5, -0.5)
        ax.set_xlim(0, span * 1.25)
        ax.set_title(f"group {g.group}: {g.question[:90]}", fontsize=8, loc="left")
        ax.tick_params(axis="x", labelsize=7)
    axes[-1, 0].set_xlabel("response token (blue generated, orange tool result, black dot a fork)", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return save_figure(fig, png)


# ---- arpo trees ---------------------------------------------------------------------------------------------------

def rl_stage(target: str | Path, output_root: str | Path = "outputs") -> Path:
    """The RL stage folder of `target`: the folder itself (it has rollouts/), a run record (outputs/runs/<name>:
    its refs.json names the RL output), or a run's name under `<output_root>/runs` (`latest` included)."""
    path = Path(target)
    if path.name == "rollouts" and path.is_dir():
        return path.parent
    if (path / "rollouts").is_dir():
        return path
    if (path / "refs.json").is_file():
        rl = json.loads((path / "refs.json").read_text()).get("rl") or {}
        rollouts = (rl.get("meta") or {}).get("rollouts")
        if not rollouts:
            raise MissingInputError(f"the run {path} has no RL output with rollout dumps (refs.json 'rl'); run RL "
                                    "with rl.trainer.dump_rollouts: true")
        return Path(rollouts).parent
    named = Path(output_root) / "runs" / str(target)
    if not path.exists() and named.exists():
        return rl_stage(named, output_root)
    raise MissingInputError(f"{target} is neither an RL stage folder (with rollouts/) nor a run (with refs.json) "
                            f"nor a run name under {Path(output_root) / 'runs'}; pass outputs/runs/<name>, latest "
                            "or outputs/rl/<key>")


def summary_table(stage: Path) -> str:
    """One line per dumped step: the tree statistics."""
    keys = [(k, label) for k, label, _ in STAT_LABELS]
    lines = ["step  " + " | ".join(label for _, label in keys)]
    for step, dump in dump_files(Path(stage) / "rollouts").items():
        stats = step_stats(read_step(dump))
        lines.append(f"{step:<5} " + " | ".join(format_stat(k, stats.get(k)).rjust(len(label)) for k, label in keys))
    return "\n".join(lines)


def trees_report(target: str | Path, step: int | None = None, group: str | None = None,
                 output_root: str | Path = "outputs", html: str | Path | None = None) -> str:
    """`arpo trees`: the per-step statistics, then the trees of one step (the newest by default) as text, every
    group or one. `html`: also write every step's page into that folder (a finished stage folder is never written
    to: for a run from before the pages, or a copy to share)."""
    stage = rl_stage(target, output_root)
    dumps = dump_files(stage / "rollouts")
    if not dumps:
        raise MissingInputError(f"{stage / 'rollouts'} holds no step_<k>.jsonl dump (rl.trainer.dump_rollouts off, or "
                                "no step finished yet)")
    written = []
    for k, dump in dumps.items() if html is not None else ():
        groups = read_step(dump)
        written.append(write_page(Path(html) / f"step_{k:06d}.html", f"Rollout trees, step {k}", str(dump),
                                  groups, step_stats(groups)))
    step = max(dumps) if step is None else step
    if step not in dumps:
        raise BadInputError(f"no dump of step {step} in {stage / 'rollouts'}; dumped steps: {sorted(dumps)}")
    groups = read_step(dumps[step])
    if group is not None:
        groups = [g for g in groups if g.group == str(group)]
        if not groups:
            raise BadInputError(f"step {step} has no group {group!r}; its groups: "
                                f"{[g.group for g in read_step(dumps[step])]}")
    parts = [f"RL stage {stage}", summary_table(stage), f"\nstep {step} ({dumps[step]}; page "
             f"{page_path(stage, step)})"]
    parts += [render_group(g) for g in groups]
    if written:
        parts.append("pages written:\n" + "\n".join(str(p) for p in written))
    return "\n\n".join(parts) + "\n"
