"""The whole chain as one Prefect flow: data -> bootstrap -> SFT (+ DPO) -> RL -> merge -> heldout -> serve -> infer
-> score -> report (the order of stages.core.stage_spec.STAGE_SPECS).

Only wiring lives here, one line per stage: every step is a task from tasks/ (cached, retried; a stage's is
`entry_task("<stage>")`, built from its table line, unless it has a module of its own), called through
`StageRunner`, which reads the stage off the task and gives it what the stage table and the run section say (its
refresh from the stage selection, the output and cache roots, its interpreter); adding a stage: CONTRIBUTING.md,
"Adding a stage". Servers are torn down in `finally` even when a step fails. The one pre-flight
(stages.core.preflight) runs before any task, and the data stage runs before the model bootstrap: a bad data file
fails in seconds, before a model is downloaded or converted.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.evaluate import FANOUT
from stages.core.config.loader import Override, Profile, load_config
from stages.core.input_files import check_rl_rows
from stages.core.preflight import after_bootstrap, preflight
from stages.core.selection import StageName, select_stages
from tasks.cost import cost_plan_task
from tasks.eval_serve import judge_serve_task, serve_task, serving_needs_task, stop_task, summarizer_serve_task
from tasks.rl import rl_task
from tasks.run_record import record_config_task, summary_task
from tasks.stage_tasks import StageRunner, entry_task, run_stage


@flow(name="arpo-pipeline", log_prints=True)
def pipeline(profile: Profile = "tiny-cpu", overrides: list[Override] | None = None,
             only: list[StageName] | None = None, until: StageName | None = None, refresh: list[StageName] | None = None,
             refresh_from: StageName | None = None, verify: bool = False) -> dict[str, Any]:
    """profile: configs/profiles/<name>.yaml; overrides: key.sub=value; only/until: which stages run (upstream
    comes from cache); refresh / refresh_from: recompute these stages (and, for refresh_from, all after it);
    verify: check every byte of each cached output before it is reused (else sizes and small files)."""
    cfg = load_config(profile, overrides or [])  # a bad key fails here, before any work
    selection = select_stages(only, until, refresh, refresh_from)
    checked = preflight(cfg, selection)  # so does a missing or malformed input file (passed already by `arpo run`)
    run_dir = record_config_task(cfg, selection.describe())
    cost_plan_task(cfg, run_dir)  # what the run will cost, before it starts (arpo plan)
    stages = StageRunner(selection, cfg.run)  # each call: refresh, output/cache roots, interpreter (run.interpreters)
    refs: dict[str, Any] = {}
    if selection.runs("data"):
        refs["data"] = data = stages.run(entry_task("data"), cfg.data)
        if selection.runs("rl"):
            check_rl_rows(cfg.rl, data)  # a train set smaller than a batch fails now, not after SFT
    if not selection.runs("bootstrap"):  # `--until data` checks the data without fetching a model
        return summary_task(run_dir, refs)
    refs["bootstrap"] = base = model = stages.run(entry_task("bootstrap"), cfg.model)
    after_bootstrap(cfg, selection, checked)  # the seam checks a first run skipped (no tokenizer yet), before SFT
    if selection.runs("sft"):
        refs["sft"] = policy = stages.run(entry_task("sft"), cfg.sft, cfg.agent, model, data)
        if cfg.sft.dpo.enabled:  # self-critic DPO belongs to the SFT stage: refreshed with it
            refs["dpo"] = policy = stages.run(entry_task("dpo"), cfg.sft, cfg.agent, policy, data)
    if selection.runs("rl"):
        refs["rl"] = policy = stages.run(rl_task, cfg.rl, cfg.agent, policy, data, seed=cfg.run.seed,
                                         dtype=cfg.model.dtype)
    if selection.runs("merge"):
        refs["merge"] = policy = stages.run(entry_task("merge"), cfg.merge, policy)
    gains = {}
    if selection.runs("heldout") and cfg.eval.stage_gains.enabled:  # what each stage bought, on one held-out split
        policies = {"base": base, "sft": refs.get("dpo", refs.get("sft")), "rl": refs.get("merge")}
        gains = {label: stages.run(entry_task("heldout", label), cfg.eval.stage_gains, cfg.agent, ref, data)
                 for label, ref in policies.items() if ref is not None}
        refs.update({f"heldout-{label}": ref for label, ref in gains.items()})
    if selection.runs("infer") and cfg.eval.enabled:
        refs.update(evaluate(cfg, selection, policy, data, run_dir, gains))
    return summary_task(run_dir, refs)


def evaluate(cfg: Any, selection: Any, model: Any, data: Any, run_dir: str, gains: dict[str, Any]) -> dict[str, Any]:
    """Serve the policy (and the judge, the summariser), fan inference + scoring out per benchmark, report; always
    tear down."""
    endpoints = []
    try:
        # a cached rerun starts no server: the expected endpoints carry the identity the cache keys hash
        needs = serving_needs_task(cfg, model, data, sorted(selection.refresh), selection.runs("score"))
        gpus = needs.gpus  # each vLLM server's GPUs, checked before any starts (stages/eval/placement.py)
        endpoint = serve_task(cfg.serve, model, run_dir, gpus.get("policy")) if needs.policy else needs.policy_endpoint
        endpoints.append(endpoint)
        judge = judge_serve_task(cfg.eval.judge, endpoint, run_dir, gpus.get("judge")) if needs.judge else \
            needs.judge_endpoint
        if judge is not None and judge.url != endpoint.url:
            endpoints.append(judge)
        summarizer = summarizer_serve_task(cfg.agent.search.summarizer, run_dir, gpus.get("summarizer")) \
            if needs.summarizer else None
        if summarizer is not None:
            endpoints.append(summarizer)
        fanout = FANOUT[cfg.eval.fanout](cfg)
        out = fanout(cfg, model, data, endpoint, judge, sorted(selection.refresh), selection.runs("score"), needs.retry,
                     summarizer)
        if selection.runs("report"):
            out["report"] = run_stage(entry_task("report"), selection, cfg.eval, out["score"], cfg.run.output_root,
                                      gains=gains)
        return out
    finally:
        for endpoint in endpoints:
            stop_task(endpoint)
