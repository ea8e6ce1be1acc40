"""Run LLaMA-Factory as a subprocess: stream its output into our logs and a progress report, keep a full log file,
raise with the log's last lines on failure, and find the checkpoint a crashed run resumes from."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from stages.core.atomic import write_yaml
from stages.core.log import get_logger
from stages.core.reporter import track
from stages.core.streams import LineForwarder

log = get_logger(__name__)

TRAINER_LOG = "trainer_log.jsonl"   # LLaMA-Factory's LogCallback: one JSON line per logging step
TAIL_LINES = 40
_BAR = re.compile(r"^\s*\d+%\|.*\|\s*(\d+)/(\d+)\s*\[")          # the description-less trainer tqdm bar
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


class LlamaFactoryError(RuntimeError):
    """LLaMA-Factory exited non-zero; the message carries the command and the last lines of its log."""


def bin_dir() -> str:
    """Folder of this interpreter's console scripts (llamafactory-cli, torchrun)."""
    return str(Path(sys.executable).parent)


def subprocess_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Our environment (offline HF variables from stages.core.env included) plus unbuffered output."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.pop("FORCE_TORCHRUN", None)
    return env | (extra or {})


def parse_log_dict(line: str) -> dict[str, Any] | None:
    """The HF trainer prints each logging step as a Python dict: "{'loss': 1.2, 'epoch': 0.5, ...}"."""
    text = line.strip()
    if not (text.startswith("{") and text.endswith("}") and "'" in text):
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None
    return value if isinstance(value, dict) else None


def run_streaming(cmd: list[str], log_path: Path, cwd: Path, env: dict[str, str], what: str) -> None:
    """Run `cmd`, tee its merged output into `log_path`, log loss lines and forward the rest with levels
    (stages.core.streams: noise counted, not repeated), report the trainer's step bar as progress with an ETA."""
    log.info("%s: %s", what, " ".join(cmd))
    output = LineForwarder(log, what, full_log=log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as sink, track(what, what, total=None) as bar:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, errors="replace")
        assert proc.stdout is not None
        try:
            for line in proc.stdout:  # text mode turns tqdm's \r refreshes into lines
                sink.write(line)
                line = line.rstrip()
                if (match := _BAR.match(line)) is not None:
                    bar.update(int(match.group(1)), int(match.group(2)))
                record = parse_log_dict(line)
                if record is None:
                    output.feed(line)
                    continue
                log.info("%s %s", what, " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                 for k, v in record.items()))
                if isinstance(record.get("loss"), float):
                    bar.note = f"loss {record['loss']:.4g}"
            code = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            output.close()
    if code != 0:
        raise LlamaFactoryError(f"{what} failed (exit code {code}): {' '.join(cmd)}\n"
                                f"last lines of {log_path}:\n" + output.last_lines(TAIL_LINES))


def run_config(args: dict[str, Any], yaml_path: Path, cmd: list[str], log_path: Path, env: dict[str, str],
               what: str) -> None:
    """Write the LLaMA-Factory YAML next to the run, then run the command on it."""
    write_yaml(yaml_path, args)
    run_streaming(cmd, log_path, cwd=yaml_path.parent, env=env, what=what)


def resume_point(output_dir: Path) -> Path | None:
    """The newest complete trainer checkpoint under `output_dir` (one with trainer_state.json), or None.

    Anything else left there by a crashed attempt is cleared, so LLaMA-Factory neither refuses the non-empty
    folder nor mixes old files into a fresh start.
    """
    if not output_dir.is_dir():
        return None
    steps = sorted(((int(m.group(1)), p) for p in output_dir.iterdir()
                    if p.is_dir() and (m := _CHECKPOINT.match(p.name))), reverse=True)
    for _, path in steps:
        if (path / "trainer_state.json").is_file():
            return path
    shutil.rmtree(output_dir)
    return None


def read_trainer_log(output_dir: Path) -> list[dict[str, Any]]:
    path = output_dir / TRAINER_LOG
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def training_metrics(output_dir: Path) -> dict[str, Any]:
    """Loss curve summary and throughput from LLaMA-Factory's trainer_log.jsonl and all_results.json."""
    steps = [r for r in read_trainer_log(output_dir) if r.get("loss") is not None]
    metrics: dict[str, Any] = {}
    results = output_dir / "all_results.json"
    if results.is_file():
        metrics |= {k: v for k, v in json.loads(results.read_text()).items() if isinstance(v, (int, float))}
    if steps:
        metrics |= {"loss_first": steps[0]["loss"], "loss_last": steps[-1]["loss"],
                    "loss_min": min(r["loss"] for r in steps), "steps": steps[-1].get("current_steps", len(steps)),
                    "total_steps": steps[-1].get("total_steps")}
    return metrics
