"""The MLflow UI comparing two real RL runs, ARPO and GRPO, their curves overlaid step by step:
docs/img/mlflow-compare.png (docs/ui.md "Where the curves go").

    .venv/bin/python scripts/mlflow_screenshot.py [--steps 6] [--root .cache/mlflow-screenshot] [--port 5077]
    .venv/bin/python scripts/mlflow_screenshot.py --replay arpo=RL_DIR --replay grpo=RL_DIR \
        [--config bench/learning.yaml --config bench/learning-arith.yaml] [-o key=value] [--name arith-s1]

1. **the runs**: with `--replay`, two finished RL stage folders (outputs/rl/<key>, or the learning benchmark's
   bench/results/learning/rl/<key>), one per algorithm, whose metrics.jsonl is used as it is; their config is
   the tiny-cpu profile with the `--config` files merged over it in order (as bench/bench_learning.py builds a
   family's) and the `-o` overrides. Without it, the tiny-cpu profile's RL stage (`run_rl`, local engine) trains
   once with `rl.algorithm=arpo` and once with `rl.algorithm=grpo`, `--steps` steps each, one after the other, on
   one torch thread; same data, same SFT policy (the test suite's tiny chain, `sft.*` as tests/conftest.py
   TINY_SFT: its folders under .cache/test-outputs/chain are linked into `--root` when they exist, otherwise SFT
   trains there first). A complete RL folder is reused (`--retrain` trains again). Each run holds ~4.5 GB of RAM.
2. **log**: a fresh MLflow store `<root>/mlflow/mlflow.db`, written the way `arpo run` writes it: per algorithm a
   pipeline run `<name>-<algorithm>-<time>` (`start_pipeline`: the resolved config as params, the tags,
   config.yaml and the algorithm card), its RL child `rl-<key[:10]>` (`stage_run`) with every row of the stage's
   metrics.jsonl at its step (`log_step`, the names the RL stage logs live), then `finish_pipeline`. The numbers
   are the runs' own.
3. **screenshot**: `mlflow server` on 127.0.0.1 against that store, the experiment's chart view (MLflow 3.17) with
   the two RL runs shown and the charts filtered to reward/mean, entropy/mean and tools/calls_per_traj, in
   headless chromium (Debian's, driven by playwright, as tests/integration/tree_browser.py:
   `ARPO_WITH_BROWSER=1 ./scripts/setup.sh`), saved to `--out`; the server is stopped after.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.core.env import PROJECT_ROOT, configure_environment  # noqa: E402
from stages.core.tracking.context import CARD_FILE  # noqa: E402

configure_environment()

ALGORITHMS = ("arpo", "grpo")
TINY_SFT = ["sft.n_trajectories=12", "sft.max_steps=6", "sft.learning_rate=3e-4"]   # tests/conftest.py TINY_SFT
TEST_OUTPUTS = PROJECT_ROOT / ".cache" / "test-outputs"
CHAIN = TEST_OUTPUTS / "chain"
EXPERIMENT = "arpo-vs-grpo"
CHARTS = ("reward/mean", "entropy/mean", "tools/calls_per_traj")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replay", action="append", default=[], metavar="ALGO=RL_DIR",
                        help="a finished RL stage folder per algorithm (arpo and grpo) instead of training")
    parser.add_argument("--config", action="append", default=[], help="YAML merged over tiny-cpu, in order")
    parser.add_argument("-o", "--override", action="append", default=[], help="config override (key=value)")
    parser.add_argument("--name", default="tiny", help="the pipeline runs' names: <name>-<algorithm>-<time>")
    parser.add_argument("--steps", type=int, default=6, help="RL steps per trained run")
    parser.add_argument("--root", default=str(PROJECT_ROOT / ".cache" / "mlflow-screenshot"))
    parser.add_argument("--out", default=str(PROJECT_ROOT / "docs" / "img" / "mlflow-compare.png"))
    parser.add_argument("--port", type=int, default=5077)
    parser.add_argument("--threads", type=int, default=1, help="torch threads while training")
    parser.add_argument("--retrain", action="store_true", help="train the two runs again")
    parser.add_argument("--only", choices=("train", "log", "shot"), help="one step only")
    return parser.parse_args(argv)


def config(args: argparse.Namespace, algorithm: str):
    """The run's resolved config: tiny-cpu, the --config files, the training settings (trained runs only), -o."""
    import yaml

    from stages.core.config.loader import deep_merge, load_config, read_yaml

    merged: dict = {}
    for path in args.config:
        merged = deep_merge(merged, read_yaml(Path(path)))
    trained = [] if args.replay else [*TINY_SFT, f"rl.trainer.total_steps={args.steps}",
                                      f"rl.trainer.save_every={args.steps}", f"rl.trainer.report_every={args.steps}"]
    overrides = [*trained, *args.override, f"rl.algorithm={algorithm}", f"run.output_root={args.root}",
                 f"run.name={args.name}-{algorithm}", f"tracking.tracking_uri={store_uri(args)}",
                 f"tracking.experiment={EXPERIMENT}"]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
        yaml.safe_dump(merged, handle)
    try:
        return load_config("tiny-cpu", overrides, extra_file=handle.name)
    finally:
        os.unlink(handle.name)


def store_uri(args: argparse.Namespace) -> str:
    return f"sqlite:///{Path(args.root).resolve() / 'mlflow' / 'mlflow.db'}"


def replayed(args: argparse.Namespace) -> dict[str, Path]:
    """Step 1 with --replay: the named folders, each with its metrics.jsonl."""
    folders = {}
    for item in args.replay:
        algorithm, _, path = item.partition("=")
        folder = Path(path).resolve()
        if algorithm not in ALGORITHMS or not (folder / "metrics.jsonl").is_file():
            raise SystemExit(f"--replay {item}: expected ALGO=RL_DIR with ALGO in {ALGORITHMS} and a metrics.jsonl "
                             "in RL_DIR")
        card = folder / CARD_FILE
        if card.is_file() and not card.read_text().startswith(f"# Algorithm card: {algorithm} "):
            raise SystemExit(f"--replay {item}: {card} is not {algorithm}'s")
        folders[algorithm] = folder
    if set(folders) != set(ALGORITHMS):
        raise SystemExit(f"--replay needs one folder per algorithm: {ALGORITHMS}")
    return folders


def link_chain(root: Path) -> None:
    """The test suite's tiny chain (bootstrap, data, TINY_SFT policy) as this root's, when it exists."""
    root.mkdir(parents=True, exist_ok=True)
    for stage in ("bootstrap", "data", "sft"):   # the chain's bootstrap is a link to the suite's converted model
        link, target = root / stage, TEST_OUTPUTS / stage if stage == "bootstrap" else CHAIN / stage
        if target.exists() and not link.exists():
            link.symlink_to(target.resolve())


def train(args: argparse.Namespace) -> dict[str, Path]:
    """Step 1: each algorithm's RL stage folder (trained now, or complete from an earlier call)."""
    import torch

    from stages.bootstrap import bootstrap_model
    from stages.data import prepare_data
    from stages.rl.stage import run_rl
    from stages.sft import run_sft

    torch.set_num_threads(args.threads)
    os.environ.pop("ARPO_TRACKING", None)   # nothing is logged while training: step 2 logs the finished rows
    link_chain(Path(args.root))
    cache = PROJECT_ROOT / ".cache"
    folders = {}
    for algorithm in ALGORITHMS:
        cfg = config(args, algorithm)
        model = bootstrap_model(cfg.model, args.root, cache)
        data = prepare_data(cfg.data, args.root)
        policy = run_sft(cfg.sft, cfg.agent, model, data, args.root, str(cache))
        start = time.perf_counter()
        ref = run_rl(cfg.rl, cfg.agent, policy, data, args.root, cache, seed=cfg.run.seed, force=args.retrain)
        folders[algorithm] = rl_folder(Path(ref.path))
        print(f"{algorithm}: {folders[algorithm]} ({time.perf_counter() - start:.0f} s)", flush=True)
    (Path(args.root) / "folders.txt").write_text("".join(f"{a} {p}\n" for a, p in folders.items()))
    return folders


def rl_folder(path: Path) -> Path:
    for folder in (path, *path.parents):
        if (folder / "metrics.jsonl").is_file():
            return folder
    raise SystemExit(f"no metrics.jsonl above {path}")


def trained(args: argparse.Namespace) -> dict[str, Path]:
    listing = Path(args.root) / "folders.txt"
    if not listing.is_file():
        raise SystemExit(f"{listing} is missing: train first (leave out --only)")
    return {a: Path(p) for a, p in (line.split(" ", 1) for line in listing.read_text().splitlines())}


def log(args: argparse.Namespace, folders: dict[str, Path]) -> None:
    """Step 2: a fresh store; per algorithm a pipeline run and its RL child with the stage's metrics.jsonl rows."""
    from stages.core import tracking
    from stages.core.atomic import read_jsonl
    from stages.core.runs import start_run
    from stages.core.tracking.pipeline import finish_pipeline, start_pipeline
    from stages.rl.card import algorithm_card, card_markdown

    store = Path(args.root) / "mlflow"
    shutil.rmtree(store, ignore_errors=True)
    shutil.rmtree(Path(args.root) / "runs", ignore_errors=True)
    for algorithm in ALGORITHMS:
        cfg = config(args, algorithm)
        run_dir = start_run(cfg, "rl")
        ctx = start_pipeline(cfg, run_dir, card_markdown(algorithm_card(cfg.rl)))
        if not ctx.active or not ctx.parent_id:
            raise SystemExit(f"the tracker did not open a run: {ctx.disabled}")
        folder = folders[algorithm]
        rows = read_jsonl(folder / "metrics.jsonl")
        record = run_dir / "rl"   # the RL folder is finished: the child's tracking.json goes beside the run instead
        record.mkdir()
        with tracking.stage_run("rl", record, key=folder.name) as run:
            if run.active:   # the folder the rows come from (stage_run's tag names the record's)
                run.tracker.set_tags(run.run_id, {"arpo.stage_dir": str(folder),
                                                  "arpo.replayed_from": str(folder / "metrics.jsonl")})
            if (folder / CARD_FILE).is_file():
                run.log_artifact(folder / CARD_FILE)
            for row in rows:
                tracking.log_step(row)
        finish_pipeline({}, ctx)
        print(f"{algorithm}: {len(rows)} steps logged from {folder / 'metrics.jsonl'} "
              f"(reward/mean {[round(r['reward/mean'], 3) for r in rows]})", flush=True)


def serve(uri: str, port: int, artifacts: Path) -> subprocess.Popen:
    """`mlflow server` on 127.0.0.1:`port` against the store `uri` (the project's process manager: its own group,
    output in <artifacts>/server.log), once /health answers."""
    from stages.core import procs

    if procs.healthy(f"http://127.0.0.1:{port}/health"):
        raise SystemExit(f"port {port} is taken: --port")
    mlflow = Path(sys.executable).with_name("mlflow")
    artifacts.mkdir(parents=True, exist_ok=True)
    proc = procs.launch([str(mlflow), "server", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port",
                         str(port), "--workers", "1", "--default-artifact-root", artifacts.as_uri()],
                        artifacts / "server.log", supervised=False)
    try:
        procs.wait_ready(proc, artifacts / "server.log", 240, lambda: procs.healthy(f"http://127.0.0.1:{port}/health"),
                         f"mlflow server on port {port}", on_fail=lambda: stop(proc))
    except procs.NotReady as err:
        raise SystemExit(str(err)) from None
    return proc


def stop(proc: subprocess.Popen) -> None:
    from stages.core import procs

    procs.kill_group(proc.pid, grace_s=20.0, proc=proc)


def runs_of(uri: str, experiment_name: str) -> tuple[str, list[str], int]:
    """The experiment's id, its pipeline runs' names and the number of its RL runs."""
    import mlflow

    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        raise SystemExit(f"no experiment {experiment_name} in {uri}: log first (leave out --only)")
    parents = client.search_runs([experiment.experiment_id], "tags.`arpo.stage` = 'pipeline'")
    rl = client.search_runs([experiment.experiment_id], "tags.`arpo.stage` = 'rl'")
    return experiment.experiment_id, [r.info.run_name for r in parents], len(rl)


def shot(args: argparse.Namespace, experiment_name: str = EXPERIMENT) -> None:
    """Step 3: the chart view of the two RL runs in headless chromium, saved to --out (PNG, 128 colours)."""
    from PIL import Image
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    if not chromium:
        raise SystemExit("Debian chromium is missing: ARPO_WITH_BROWSER=1 ./scripts/setup.sh")
    uri = store_uri(args)
    experiment, parents, rl = runs_of(uri, experiment_name)
    if rl != 2 or len(parents) != 2:
        raise SystemExit(f"expected 2 pipeline runs with an RL run each, found {len(parents)} and {rl}")
    proc = serve(uri, args.port, Path(args.root) / "mlflow" / "artifacts")
    out = Path(args.out)
    try:
        with sync_playwright() as driver:
            browser = driver.chromium.launch(executable_path=chromium, headless=True, args=FLAGS)
            try:
                tab = browser.new_page(viewport={"width": 1500, "height": 2200})  # every chart drawn while arranging
                tab.goto(f"http://127.0.0.1:{args.port}/#/experiments/{experiment}/runs?workflowType="
                         "machine_learning&compareRunsMode=CHART", wait_until="load", timeout=240_000)
                bottom = arrange(tab, parents)
                tab.set_viewport_size({"width": 1500, "height": 900})
                tab.mouse.move(2, 2)   # no hover toolbar on a chart
                tab.wait_for_timeout(2000)
                tab.screenshot(path=str(out), clip={"x": 0, "y": 0, "width": 1500, "height": min(900, bottom + 24)})
            finally:
                browser.close()
    finally:
        stop(proc)
    image = Image.open(out).convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT)
    image.save(out, optimize=True)
    print(f"{out}: {out.stat().st_size // 1024} KB", flush=True)


def arrange(tab, parents: list[str]) -> float:
    """MLflow 3.17's chart view (Model training): the assistant panel closed, each pipeline run expanded to show
    its RL run and hidden itself (no curves of its own), the charts filtered to CHARTS and the three dragged into
    one row. Returns the bottom of that row (CSS px)."""
    card = '[data-testid="experiment-view-compare-runs-card"]'
    tab.get_by_text(parents[0]).first.wait_for(timeout=240_000)
    tab.wait_for_timeout(1500)
    close = tab.locator('button[data-component-id="mlflow.assistant.chat_panel.close"]')
    if close.count():
        close.first.click()
    for name in parents:
        row = tab.locator("[role=row]", has=tab.get_by_text(name, exact=True))
        row.locator('button[data-component-id$="runnamecellrenderer.tsx_46"]').first.click()   # expand
        tab.wait_for_timeout(500)
        row.locator('label:has-text("Hide run")').first.click()
        tab.wait_for_timeout(500)
    tab.get_by_placeholder("Search metric charts").fill("^(" + "|".join(CHARTS) + ")$")
    tab.wait_for_timeout(2000)

    def chart(metric: str):
        return tab.locator(card, has=tab.get_by_text(metric, exact=True)).first

    first, *others = sorted(CHARTS)   # sections are sorted by prefix: the first chart's section takes the others,
    for metric in reversed(others):    # each dropped right after the first chart (so they keep their order)
        handle = chart(metric).locator('[data-testid="experiment-view-compare-runs-card-drag-handle"]').bounding_box()
        target = chart(first).bounding_box()
        tab.mouse.move(handle["x"] + handle["width"] / 2, handle["y"] + handle["height"] / 2)
        tab.mouse.down()
        tab.mouse.move(target["x"] + target["width"] * 1.3, target["y"] + target["height"] / 2, steps=20)
        tab.wait_for_timeout(300)
        tab.mouse.up()
        tab.wait_for_timeout(1000)
    boxes = [chart(metric).bounding_box() for metric in CHARTS]
    if len({round(b["y"]) for b in boxes}) != 1:
        raise SystemExit(f"the charts are not in one row: {boxes}")
    return max(b["y"] + b["height"] for b in boxes)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.root = str(Path(args.root).resolve())
    if args.replay:
        folders = replayed(args)
    else:
        folders = train(args) if args.only in (None, "train") else trained(args)
    if args.only in (None, "log"):
        log(args, folders)
    if args.only in (None, "shot"):
        shot(args)


if __name__ == "__main__":
    main()
