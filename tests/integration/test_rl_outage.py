"""Outages are not the policy's fault, in a real RL run on the tiny model (run_rl, the local engine, 2 ARPO steps):

- search goes to a retrieval server over real HTTP that answers new queries in turn 503, ok, 429, ok, each failing
  query every time it is asked (so the client's 3 attempts do not help);
- the python sandbox dies before each step (its warm parent is killed) and cannot start again (1 ms start-up
  time: no interpreter is ready that fast), so every python call fails before any code runs.

The trajectories those failures touched carry no loss (advantage 0, out of their group's statistics: the kept
ones' advantages are GRPO over the kept rewards alone), each step counts them (`tools/infra_failures`,
`rollout/masked_trajectories`) and raises the `infra_failures` alarm. The same run is the measured tiny run
`arpo plan` is checked against: its bounds hold and its projection from the first step lands within the stated
error of the two steps' totals.

The untrained 135M model rarely opens a tool call by itself, so each prompt ends with an assistant prefix that
opens one (`<search>` for the QA task, `<python>` for the math task); the model writes the call and closes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stages.agent.search.local import BM25Backend
from stages.agent.search.server import ATTEMPTS
from stages.core.atomic import read_jsonl, write_jsonl
from stages.core.config.loader import load_config
from stages.core.refs import DatasetRef
from stages.core.rl_parquet import make_row, read_rl_parquet, write_rl_parquet
from stages.cost import estimate, measured_run, read_measured
from stages.generation.prompt_items import PromptItem, build_prompt_items
from stages.generation.session import RolloutSession
from tests.conftest import module_scratch
from tests.unit.outage_support import FlakyProvider, kill_sandbox
from tests.unit.test_agent_search import serve_in_thread

pytestmark = [pytest.mark.integration, pytest.mark.slow]
torch.set_num_threads(1)
PRIMERS = {"qa": "<think>I will search for it.</think>\n<search>", "math": "<think>I will compute it.</think>\n<python>"}
EPS = 1e-6


class PrimedSession(RolloutSession):
    """RL's rollout session with each prompt ending in an opened tool call (see the module docstring), whose python
    sandbox is killed before each rollout."""

    def rollout(self, rows, seed):
        kill_sandbox(self.toolbox.tool("python").sandbox)
        items = build_prompt_items(rows, self.tokenizer, self.cfg.max_prompt_length, self.cfg.prompt_overflow)
        primed = [PromptItem(p.group, p.prompt_ids + self.tokenizer.encode(PRIMERS[p.ability],
                                                                           add_special_tokens=False),
                             p.question, p.ground_truth, p.ability) for p in items]
        return self.new_rollout(seed).rollout(primed)


@pytest.fixture(scope="module")
def outage_run(request, tiny_model, synthetic_data, tmp_path_factory):
    """One QA and one math prompt per step, 2 steps; the provider fails, the sandbox cannot start."""
    import stages.rl.trainer as trainer_module
    from stages.rl.stage import run_rl

    root = module_scratch(request, tmp_path_factory.mktemp("rl-outage"))
    rows = read_rl_parquet(synthetic_data.file("rl_train"))
    picked = [next(r for r in rows if r.ability == "qa"), next(r for r in rows if r.ability == "math")]
    train = write_rl_parquet([make_row(i, r.data_source, r.ability, r.system, r.question, r.ground_truth, "train")
                              for i, r in enumerate(picked)], root / "data" / "rl_train.parquet")
    data = DatasetRef(path=str(root / "data"), fingerprint="outage-data",
                      files={"rl_train": str(train), "corpus": synthetic_data.files["corpus"]})
    provider = FlakyProvider(BM25Backend(synthetic_data.files["corpus"], root / "index"))
    patch = pytest.MonkeyPatch()
    patch.setattr(trainer_module, "RolloutSession", PrimedSession)
    try:
        with serve_in_thread(provider.app()) as url:
            cfg = load_config("tiny-cpu", [
                "rl.algorithm=arpo", "rl.rollout.n=4", "rl.rollout.initial_rollouts=2", "rl.rollout.call_limit=1",
                "rl.rollout.max_response_length=64", "rl.trainer.total_steps=2", "rl.trainer.train_batch_size=2",
                "rl.trainer.ppo_mini_batch_size=2", "rl.trainer.micro_batch_size=4", "rl.trainer.save_every=2",
                "rl.alarms.infra_share=0.25", "agent.search.backend=server", f"agent.search.server_url={url}",
                "agent.search.top_k=1", "agent.search.max_chars_per_passage=120", "agent.python.sandbox=rlimit",
                "agent.python.preload=[]", "agent.python.startup_timeout_s=0.001",
                f"run.output_root={root / 'out'}", "cost.search_price_per_1000=4.0"])
            ref = run_rl(cfg.rl, cfg.agent, tiny_model, data, cfg.run.output_root, root / "cache", seed=0)
    finally:
        patch.undo()
    stage = Path(ref.meta["metrics"]).parent
    dumps = [stage / "rollouts" / f"step_{s:06d}.jsonl" for s in (1, 2)]
    steps = [(row["step"], row.get("resumed_from")) for row in read_jsonl(stage / "metrics.jsonl")]
    assert all(d.is_file() for d in dumps), (sorted(str(f.relative_to(stage)) for f in stage.rglob("*")), steps)
    return {"cfg": cfg, "stage": stage, "provider": provider, "metrics": read_jsonl(stage / "metrics.jsonl"),
            "math_question": picked[1].question,
            "dumps": [read_jsonl(dump) for dump in dumps]}


def _touched(text: str) -> bool:
    """The response shows a search provider failure or a sandbox that did not start."""
    return "The search tool failed" in text or "failed to start" in text


def test_outage_hit_trajectories_carry_no_loss_and_are_counted(outage_run):
    provider, metrics = outage_run["provider"], outage_run["metrics"]
    assert [r["step"] for r in metrics] == [1, 2]
    assert provider.failed_queries, "no search query failed: the provider's outage never happened"
    for row, dump in zip(metrics, outage_run["dumps"]):
        masked = [t for t in dump if t["masked"]]
        assert masked, "no trajectory was touched by the outage"
        for t in dump:  # (a result cut by the response budget may not show its message: one direction only)
            assert t["masked"] == (t["infra_failures"] > 0) and (t["masked"] or not _touched(t["response"]))
        assert row["rollout/masked_trajectories"] == len(masked)
        assert row["rollout/masked_share"] == pytest.approx(len(masked) / len(dump))
        assert row["tools/infra_failures"] >= 1
        # the math prompt's sandbox never started: every one of its trajectories that called python is masked
        math = [t for t in dump if t["question"] == outage_run["math_question"] and t["tool_calls"].get("python")]
        assert all(t["masked"] for t in math)
        # no loss: advantage 0 on every masked trajectory; the kept ones get GRPO over the kept rewards alone
        for group in {t["group"] for t in dump}:
            members = [t for t in dump if t["group"] == group]
            kept = torch.tensor([t["reward"]["score"] for t in members if not t["masked"]], dtype=torch.float64)
            for t in members:
                if t["masked"]:
                    assert t["advantage"] == 0.0
                    continue
                std = float(kept.std()) if len(kept) > 1 else 0.0
                want = 0.0 if len(kept) == 1 else (t["reward"]["score"] - float(kept.mean())) / (std + EPS)
                assert t["advantage"] == pytest.approx(want, abs=1e-4)
        # the alarm: at least a quarter of the step's trajectories were left out
        assert (row.get("alarm/infra_failures") == 1.0) == (row["rollout/masked_share"] >= 0.25)
    alarms = read_jsonl(outage_run["stage"] / "alarms.jsonl")
    assert any(a["name"] == "infra_failures" for a in alarms)
    # a failing query was never answered from the cache: every call of it reached the provider 3 times
    for query in provider.failed_queries:
        assert sum(q == query for q, _ in provider.requests) % ATTEMPTS == 0


def test_the_plan_holds_against_the_measured_tiny_run(outage_run, tmp_path):
    cfg, metrics, provider = outage_run["cfg"], outage_run["metrics"], outage_run["provider"]
    lines = {line.what: line for line in estimate(cfg, train_rows=2).lines}
    # exact: the run did precisely this
    assert lines["prompts"].per_run == 2 * 2 and lines["trajectories"].per_step == metrics[0]["rollout/trajectories"]
    assert lines["trajectories"].per_run == sum(r["rollout/trajectories"] for r in metrics)
    # bounds: never exceeded, per step and per run (provider requests counted by the server itself, retries included)
    actual = {"generated tokens": [r["response/model_tokens"] * r["rollout/trajectories"] for r in metrics],
              "tool calls": [r["rollout/tool_calls_executed"] for r in metrics],
              "search calls": [r.get("rollout/search_calls_executed", 0.0) for r in metrics],
              "python calls": [r.get("rollout/python_calls_executed", 0.0) for r in metrics]}
    for what, values in actual.items():
        assert max(values) <= lines[what].per_step and sum(values) <= lines[what].per_run, what
    assert len(provider.requests) <= lines["search requests (all retried)"].per_run
    assert len(provider.requests) * 4.0 / 1000 <= lines["search cost"].per_run * ATTEMPTS
    # the measured run is found by its per-step settings (run_rl wrote them into its stage folder)
    assert measured_run(cfg).source == str(outage_run["stage"] / "metrics.jsonl")
    # projected from the first step alone (a "short run"), the two-step totals land within the stated error
    write_jsonl(tmp_path / "metrics.jsonl", metrics[:1])
    projected = {line.what: line for line in estimate(cfg, 2, read_measured(tmp_path)).lines}
    for what, values in actual.items():
        line = projected[what]
        assert line.basis == "measured" and line.error == cfg.cost.tolerance
        assert abs(sum(values) - line.per_run) <= line.error * line.per_run + 1e-9, (what, values, line)
    step_s = metrics[0]["timing/step_s"]
    assert projected["device-hours"].per_run == pytest.approx(2 * step_s / 3600)   # 1 device, measured step time
    print(json.dumps({w: {"projected": projected[w].per_run, "bound": lines[w].per_run, "actual": sum(v)}
                      for w, v in actual.items()} | {"provider requests": len(provider.requests),
                                                      "step_s": [r["timing/step_s"] for r in metrics]}))
