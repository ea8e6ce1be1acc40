#!/usr/bin/env python3
"""The first GPU day as one command (docs/gpu-runbook.md "The first GPU day"): the runbook's first steps in order,
each logged, then one report that says which lever comes first (the tool pool, async rollouts, or nothing) from
the measured step.

    ./scripts/first-gpu-day.sh [--out first-gpu-day] [--dry-run] [--metrics FILE] [--keep-going]

1. verl-gpu-test: the verl engine on one GPU (tests/integration/test_rl_verl_gpu.py: tied SmolLM2, ARPO, 2 steps,
   cache hit, resume, merge with parity).
2. served-vllm: which vLLM `.venv-verl` serves, checked against every vLLM object our code touches
   (scripts/vllm_contract.py --installed); which entropy replica served is read from step 3's run.
3. step-14b: one RL step of `arpo-qwen3-14b-deepsearch` from the released ARPO 14B checkpoint (no SFT: a policy
   that calls tools as the trained one does), its time split read from metrics.jsonl; the entropy replica it
   configured (verl_inputs/overrides.txt) and the server class its log names.
4. parity: `parity-qwen3-14b-arpo-deepsearch` on GAIA and HLE: ours, published, the gap with its interval.

`--dry-run` (CPU, CI: tests/unit/test_first_gpu_day.py) runs nothing heavy: it loads every step's config with its
overrides (a bad key fails here), checks the files each step needs, runs the vLLM check against whichever vLLM
environment is there, and writes the report with the lever from `--metrics` when given.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MAIN_PY, VERL_PY, VLLM_PY = ".venv/bin/python", ".venv-verl/bin/python", ".venv-vllm/bin/python"
STEP_PROFILE, PARITY_PROFILE = "arpo-qwen3-14b-deepsearch", "parity-qwen3-14b-arpo-deepsearch"
RELEASED_14B = "dongguanting/Qwen3-14B-ARPO-DeepSearch"
# the rollout's time split per step (stages/rl/step_metrics.py, both engines)
SPLIT = {"step_s": "timing/step_s", "rollout_s": "timing/rollout_s", "generate_s": "timing/generate_s",
         "tools_s": "timing/tools_s", "tool_queue_s": "timing/tool_queue_s",
         "calls_per_round": "tools/calls_per_round"}
QUEUE_SHARE = 0.25   # queueing >= this share of tool time: calls wait for a pool thread or a rate-limit slot
TOOL_SHARE = 0.25    # tools >= this share of the rollout (no queue to blame): the GPU idles while tools run


@dataclass
class Step:
    name: str
    what: str
    command: list[str]
    profile: str | None = None                 # the config the command loads (checked in a dry run)
    overrides: list[str] = field(default_factory=list)
    needs: list[str] = field(default_factory=list)  # files the step reads (relative to the repository)
    timeout_s: int = 3 * 3600
    status: str = "not run"
    seconds: float | None = None
    log: str | None = None


def plan(out: Path) -> list[Step]:
    runs = str(out / "runs")
    step_o = ["rl.trainer.total_steps=1", f"model.path={RELEASED_14B}", "sft.enabled=false",
              f"run.output_root={runs}/step-14b"]
    parity_o = ["eval.benchmarks=[gaia,hle]", "eval.browse=[gaia,hle]", f"run.output_root={runs}/parity"]
    cli = [MAIN_PY, "-m", "flows.cli", "run"]
    return [
        Step("verl-gpu-test", "the verl engine on one GPU: tied SmolLM2, ARPO, 2 steps, resume, merge",
             [VERL_PY, "-m", "pytest", "-m", "gpu", "-q", "tests/integration/test_rl_verl_gpu.py"],
             needs=["tests/integration/test_rl_verl_gpu.py"], timeout_s=3600),
        Step("served-vllm", "which vLLM serves, against every vLLM object our code touches",
             [VERL_PY, "scripts/vllm_contract.py", "--installed"], needs=["scripts/vllm_contract.py"], timeout_s=300),
        Step("step-14b", f"one RL step of {STEP_PROFILE} from {RELEASED_14B}",
             [*cli, "-p", STEP_PROFILE, "--until", "rl", *sum((["-o", o] for o in step_o), [])],
             profile=STEP_PROFILE, overrides=step_o),
        Step("parity", f"{PARITY_PROFILE} on GAIA and HLE",
             [*cli, "-p", PARITY_PROFILE, *sum((["-o", o] for o in parity_o), [])],
             profile=PARITY_PROFILE, overrides=parity_o),
    ]


def run_step(step: Step, out: Path) -> bool:
    log = out / f"{step.name}.log"
    step.log, start = str(log.relative_to(out)), time.monotonic()
    with open(log, "w") as handle:
        try:
            proc = subprocess.run(step.command, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                                  timeout=step.timeout_s)
            step.status = "passed" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            step.status = f"failed (past {step.timeout_s} s)"
        except FileNotFoundError as exc:
            step.status = f"failed ({exc.filename} missing: ./scripts/setup-gpu.sh builds it)"
    step.seconds = time.monotonic() - start
    return step.status == "passed"


def check_step(step: Step, out: Path) -> bool:
    """The dry run of one step: its config loads with its overrides, its files are there."""
    from stages.core.config.loader import load_config

    problems = [f"{n} missing" for n in step.needs if not (ROOT / n).is_file()]
    if step.profile:
        try:
            load_config(step.profile, step.overrides)
        except Exception as exc:  # noqa: BLE001 - the report names whatever refuses the config
            problems.append(f"config: {exc}")
    if step.name == "served-vllm":  # the one step a CPU box can run: against whichever vLLM environment is here
        python = next((p for p in (VERL_PY, VLLM_PY) if (ROOT / p).is_file()), None)
        if python is None:
            problems.append(f"no vLLM environment ({VERL_PY}, {VLLM_PY})")
        else:
            step.command[0] = python
            passed = run_step(step, out)
            step.status += f" ({python}'s vLLM)" + "".join(f"; {p}" for p in problems)
            return passed and not problems
    step.status = "; ".join(problems) if problems else "checked (dry run)"
    return not problems


def time_split(metrics: Path) -> dict[str, float] | None:
    """The first step's time split, from a run's metrics.jsonl; None without one."""
    if not metrics.is_file():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if not rows:
        return None
    return {name: float(rows[0][key]) for name, key in SPLIT.items() if key in rows[0]}


def lever(split: dict[str, float] | None) -> tuple[str, str]:
    """(lever, why): `tool pool` when calls queue for a pool thread or a rate-limit slot, `async rollouts` when the
    GPU waits on tools that do not queue, `nothing` when generation fills the rollout."""
    needed = ("generate_s", "tools_s", "tool_queue_s")
    if split is None or any(k not in split for k in needed):
        missing = "no step ran" if split is None else f"metrics.jsonl lacks {[SPLIT[k] for k in needed if k not in split]}"
        return "not measured", missing
    gen, tools, queue = (split[k] for k in needed)
    rollout = gen + tools
    numbers = f"generate {gen:.1f} s, tools {tools:.1f} s of which queued {queue:.1f} s"
    if tools > 0 and queue >= QUEUE_SHARE * tools:
        return "tool pool", (f"{numbers}: calls queued {queue / tools:.0%} of the tool time (>= {QUEUE_SHARE:.0%}) "
                             "for a pool thread or a rate-limit slot; raise agent.concurrency or the provider's rate "
                             "first (`arpo plan` prices it)")
    if rollout > 0 and tools >= TOOL_SHARE * rollout:
        return "async rollouts", (f"{numbers}: tools take {tools / rollout:.0%} of the rollout (>= {TOOL_SHARE:.0%}) "
                                  "without queueing: the GPU waits on the tools, which overlapping rollouts hide")
    return "nothing", (f"{numbers}: generation fills {gen / rollout:.0%} of the rollout; neither lever buys much"
                       if rollout > 0 else f"{numbers}: nothing measured")


def entropy_replica(stage_root: Path) -> list[str]:
    """Which entropy path the 14B step configured and which server its log names."""
    overrides = sorted(stage_root.glob("rl/*/verl_inputs/overrides.txt"))
    if not overrides:
        return ["no verl run folder (step-14b did not run)"]
    text = overrides[-1].read_text()
    found = re.search(r"ARPO_VERL_ENTROPY=(\w+)", text)
    quantity = found.group(1) if found else "not set"
    expected = "ours (ArpoTopk...Server, stages/rl/verl/topk_server.py)" if quantity == "topk" \
        else "verl's stock vLLMHttpServer"
    log = overrides[-1].parent.parent / "verl.log"
    seen = log.read_text(errors="replace") if log.is_file() else ""
    named = "ArpoTopk" in seen
    return [f"entropy quantity `{quantity}`: the replica should be {expected}",
            f"verl.log {'names' if named else 'does not name'} the ArpoTopk server"
            + ("" if named == (quantity == "topk") else " (MISMATCH: check stages/rl/verl/plugin.py's registration)")]


def render(steps: list[Step], split: dict[str, float] | None, out: Path, dry_run: bool) -> str:
    from stages.eval.parity import parity_section

    choice, why = lever(split)
    lines = ["# First GPU day" + (" (dry run)" if dry_run else ""), "",
             f"**Lever first: {choice}.** {why}.", "",
             "| step | what | status | seconds | log |", "|---|---|---|---|---|"]
    lines += [f"| {s.name} | {s.what} | {s.status} | {'-' if s.seconds is None else f'{s.seconds:.0f}'} | "
              f"{s.log or '-'} |" for s in steps]
    lines += ["", "## The 14B step's time split (metrics.jsonl, step 1)", ""]
    lines += [f"- {SPLIT[k]}: {v:.2f}" for k, v in (split or {}).items()] or ["- not measured"]
    served = next(s for s in steps if s.name == "served-vllm")
    vllm_log = (out / served.log).read_text().strip() if served.log and (out / served.log).is_file() else "not run"
    lines += ["", "## Which vLLM and which entropy replica served", "", f"- contract check: {vllm_log}",
              *(f"- {line}" for line in entropy_replica(out / "runs" / "step-14b")), ""]
    reports = sorted((out / "runs" / "parity").glob("report/*/report.md"))
    section = parity_section(reports[-1].read_text()) if reports else ""
    lines += [section.replace("## ", "## Released-checkpoint ", 1) if section else "## Paper parity\n\nnot run\n"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "first-gpu-day", help="logs, runs and the report")
    parser.add_argument("--dry-run", action="store_true", help="check every step on CPU; run none of the GPU ones")
    parser.add_argument("--metrics", type=Path, help="a metrics.jsonl to read the time split from (dry run)")
    parser.add_argument("--keep-going", action="store_true", help="run the later steps after a failure")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    steps, ok = plan(out), True
    for step in steps:
        if not ok and not args.keep_going:
            step.status = "not run (an earlier step failed)"
            continue
        print(f"[first-gpu-day] {step.name}: {' '.join(step.command)}", flush=True)
        ok = (check_step(step, out) if args.dry_run else run_step(step, out)) and ok
        print(f"[first-gpu-day] {step.name}: {step.status}", flush=True)
    metrics = args.metrics or next(iter(sorted((out / "runs" / "step-14b").glob("rl/*/metrics.jsonl"))), None)
    split = time_split(metrics) if metrics else None
    report = render(steps, split, out, args.dry_run)
    (out / "first-gpu-day.md.tmp").write_text(report)
    (out / "first-gpu-day.md.tmp").replace(out / "first-gpu-day.md")
    print(report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
