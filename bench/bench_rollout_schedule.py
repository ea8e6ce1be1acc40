"""Rollout wall time per rollout schedule (rl.rollout.schedule), as ratios against `rounds` measured in the same run,
with injected tool latency; the critical-path model checked against the measured times.

    nice -n 10 .venv/bin/python bench/bench_rollout_schedule.py [--trees 6] [--medians 0.5,1.5,4]
                                                                [--time-scale 0.1] [--no-write]

The backend is a scripted server (tests/unit/test_rl_rollout_fakes.ScriptedBackend under a latency model): its
requests run concurrently, each taking `first_ms` + `token_ms` per generated token, and it answers one by one
(`generate_iter`, as verl's LLM server does) or, under `rounds`, all at once. The scripted policy writes filler
text then a search (p_call, at most 3 per trajectory) or an answer, its lengths and entropies a pure function of
(context, trajectory key), so both schedules grow the same ARPO trees (checked: the runs must give equal batches).
Each search takes a lognormal latency (median m, sigma 0.8) drawn from a hash of its query, the same call
taking the same time under every schedule; calls run with unbounded concurrency (a large agent.concurrency).

One tree per rollout call, trees one after another (as one verl agent-loop worker's tree, alone on its replica).
All latencies are multiplied by --time-scale so the run stays short; ratios do not depend on it as long as the
driver's own overhead is small (the measured/model column shows how small).

Model, per round r of a tree: `rounds` = max_i g_i + max_{i calls} t_i; `early_tools` = max_i (g_i + t_i) (t_i = 0
without a call); a tree's time is the sum over its rounds. The slowest-tree tail is max/mean of the trees' times.
--tiny adds the real tiny model (SmolLM2-135M, transformers backend, CPU; its decode loop hands each row over as
it finishes, so its tool call overlaps the other rows' decoding) with the real toolbox (local BM25 search over the
generated corpus) plus the same injected latency, not scaled (the decode time is real): one TreeRollout over
--tiny-prompts prompts (the local engine's step), both schedules from one seed; the batches must be equal, bit for
bit. No critical-path column there (a row's decode time is not known in advance). The in-process vLLM backend
answers a round at once (no `generate_iter`): under it `early_tools` runs as `rounds`.

The step section (`--step-trees` trees in ONE rollout call, the local engine's step) adds `async`: every schedule
runs on counter seeds there (`seeding="counter"`), so all three grow the same trees (checked). Its model: `rounds`
= per generate call max gen + max tool; `early_tools` = per call max (gen + tool); `async` = each trajectory's
segments back to back, a copy or fresh root starting at the close of the round that made it, the step ending at
the last close: a lower bound (a request that becomes ready while a batch runs waits for it).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import write_result
from stages.core.config.rl import RolloutSection
from stages.generation.prompt_items import PromptItem
from stages.rl.rollout import TreeRollout
from tests.unit.test_rl_rollout_fakes import EOS, ScriptedBackend, ToyResult, ToyState, ToyTokenizer

SCHEDULES = ("rounds", "early_tools")
STEP_SCHEDULES = ("rounds", "early_tools", "async")
SIGMA = 0.8
P_CALL, MAX_SEARCHES = 0.7, 3


def unit(*parts: object) -> float:
    """A uniform [0, 1) number that is a pure function of `parts`."""
    return random.Random(zlib.crc32(repr(parts).encode())).random()


def policy(ctx: str, key) -> tuple[str, float]:
    """Filler of 20-120 characters, then a search (p_call, at most MAX_SEARCHES) or the answer."""
    results = ctx.count("</result>")
    filler = "t" * (20 + int(100 * unit("len", ctx[-40:], key, results)))
    entropy = 0.2 + 0.6 * unit("h", key, results)
    if results < MAX_SEARCHES and unit("call", key, results) < P_CALL:
        return f"{filler}<search>k{zlib.crc32(repr(key).encode()) % 10**6}r{results}</search>", entropy
    return f"{filler}<answer>A</answer>{EOS}", entropy


@dataclasses.dataclass
class LatencyServer(ScriptedBackend):
    """Requests run concurrently, each `first_s + token_s * tokens`; the tree's rounds (g_i, query_i) are kept."""

    first_s: float = 0.02
    token_s: float = 0.002
    rounds: list[list[tuple[float, str | None]]] = dataclasses.field(default_factory=list)
    keys: list[list] = dataclasses.field(default_factory=list)   # each call's request keys

    def _timed(self, requests, sampling, seed):
        results = ScriptedBackend.generate(self, requests, sampling, seed)
        times = [self.first_s + self.token_s * len(r.token_ids) for r in results]
        queries = []
        for r in results:
            text = self.tokenizer.decode(r.token_ids)
            queries.append(text.split("<search>")[-1][:-len("</search>")] if r.finish_reason == "stop" else None)
        self.rounds.append(list(zip(times, queries)))
        self.keys.append([r.key for r in requests])
        return results, times

    def generate(self, requests, sampling, seed=None):
        results, times = self._timed(requests, sampling, seed)
        time.sleep(max(times, default=0.0))
        return results

    def generate_iter(self, requests, sampling, seed=None):
        start = time.perf_counter()
        results, times = self._timed(requests, sampling, seed)
        for i in sorted(range(len(results)), key=lambda i: times[i]):
            time.sleep(max(0.0, start + times[i] - time.perf_counter()))
            yield i, results[i]


@dataclasses.dataclass
class LatencyTools:
    """Search with a lognormal latency per query (median `median_s`), calls of a batch concurrent."""

    median_s: float

    def latency(self, query: str) -> float:
        u = min(max(unit("tool", query), 1e-9), 1 - 1e-9)
        return self.median_s * math.exp(SIGMA * normal_quantile(u))

    def new_state(self) -> ToyState:
        return ToyState()

    def execute_many(self, calls):
        time.sleep(max(self.latency(c.argument) for c, _ in calls))
        return [ToyResult(c.tool, f"R:{c.argument}", True) for c, _ in calls]


def normal_quantile(u: float) -> float:
    from statistics import NormalDist

    return NormalDist().inv_cdf(u)


def model_s(rounds: list[list[tuple[float, str | None]]], tools: LatencyTools, schedule: str) -> float:
    total = 0.0
    for requests in rounds:
        tool = [tools.latency(q) if q is not None else 0.0 for _, q in requests]
        if schedule == "rounds":
            total += max(g for g, _ in requests) + max(tool)
        else:
            total += max(g + t for (g, _), t in zip(requests, tool))
    return total


def run_tree(schedule: str, tree: int, median_s: float, scale: float, cfg: RolloutSection):
    tok = ToyTokenizer()
    backend = LatencyServer(tok, policy, first_s=0.02 * scale, token_s=0.002 * scale)
    tools = LatencyTools(median_s * scale)
    driver = TreeRollout(backend, tools, tok, cfg.model_copy(update={"schedule": schedule}), "arpo",
                         show_progress=False)
    prompt = PromptItem(tree, tok.encode(f"user: question {tree}\nassistant:"), f"q{tree}", "A", "qa")
    start = time.perf_counter()
    batch = driver.rollout([prompt], seed=1000 + tree)
    wall = time.perf_counter() - start
    rows = [(t.traj_id, t.parent_id, t.fork_at, t.response_ids) for t in batch.trajectories]
    return wall, model_s(backend.rounds, tools, schedule), rows, batch.metrics


def step_model_s(backend: LatencyServer, tools: LatencyTools, schedule: str, n: int) -> float:
    """The step's critical path from a `rounds` run's calls (every call one round of every group; key // n = the
    group under counter seeds): rounds and early_tools as per tree. async: each trajectory starts its segment when
    its previous one is complete (a copy or fresh root when the round that made it closed), a group's round closes
    when its members' segments are complete; the step ends with the last close (a lower bound: a request that
    becomes ready while a batch runs waits for it)."""
    if schedule != "async":
        return model_s(backend.rounds, tools, schedule)
    complete: dict = {}
    closed: dict[int, float] = {}
    for requests, keys in zip(backend.rounds, backend.keys):
        ends: dict[int, float] = {}
        for (g, q), key in zip(requests, keys):
            group = key // n
            start = complete.get(key, closed.get(group, 0.0))
            complete[key] = start + g + (tools.latency(q) if q is not None else 0.0)
            ends[group] = max(ends.get(group, 0.0), complete[key])
        for group, end in ends.items():
            closed[group] = max(closed.get(group, 0.0), end)
    return max(closed.values())


def step_bench(args, cfg: RolloutSection) -> list[list]:
    """`--step-trees` trees in one rollout call under each schedule, all on counter seeds (the same trees)."""
    rows = []
    for median in [float(m) for m in args.medians.split(",")]:
        walls, models, batches, rounds_backend = {}, {}, {}, None
        for schedule in STEP_SCHEDULES:
            tok = ToyTokenizer()
            backend = LatencyServer(tok, policy, first_s=0.02 * args.time_scale, token_s=0.002 * args.time_scale)
            tools = LatencyTools(median * args.time_scale)
            driver = TreeRollout(backend, tools, tok, cfg.model_copy(update={"schedule": schedule}), "arpo",
                                 show_progress=False, seeding="counter")
            prompts = [PromptItem(t, tok.encode(f"user: question {t}\nassistant:"), f"q{t}", "A", "qa")
                       for t in range(args.step_trees)]
            start = time.perf_counter()
            batch = driver.rollout(prompts, seed=2000)
            walls[schedule] = time.perf_counter() - start
            batches[schedule] = [(t.traj_id, t.parent_id, t.fork_at, t.response_ids) for t in batch.trajectories]
            rounds_backend = backend if schedule == "rounds" else rounds_backend
            models[schedule] = step_model_s(rounds_backend, tools, schedule, cfg.n)
        if not batches["rounds"] == batches["early_tools"] == batches["async"]:
            raise SystemExit(f"step, median {median} s: the schedules grew different trees on counter seeds")
        for schedule in STEP_SCHEDULES:
            rows.append([median, schedule, round(walls[schedule] / args.time_scale, 2),
                         round(walls[schedule] / walls["rounds"], 3), round(models[schedule] / models["rounds"], 3),
                         round(walls[schedule] / models[schedule], 3)])
            print(f"step of {args.step_trees} trees, median {median:g} s {schedule:12s} {rows[-1][2]:6.2f} s "
                  f"(unscaled)  ratio {rows[-1][3]:.3f}  model ratio {rows[-1][4]:.3f}  measured/model {rows[-1][5]:.3f}")
    return rows


@dataclasses.dataclass
class SlowedToolBox:
    """The real toolbox, each call then held for its injected lognormal latency (concurrent calls overlap)."""

    box: object
    latency: LatencyTools

    @property
    def tools(self) -> tuple[str, ...]:
        return self.box.tools

    def new_state(self):
        return self.box.new_state()

    def execute_many(self, calls):
        start = time.perf_counter()
        results = self.box.execute_many(calls)
        wait = max(self.latency.latency(f"{c.argument}|{s.total}") for c, s in calls)
        time.sleep(max(0.0, start + wait - time.perf_counter()))
        return results


def tiny_bench(args) -> list[list]:
    import tempfile

    from bench.bench_rollout import load
    from stages.agent.toolbox import ToolBox
    from stages.core.config.agent import SearchSection
    from stages.generation import load_backend

    load_args = argparse.Namespace(threads=1, prompts=args.tiny_prompts)
    config, model, tok, data, prompts = load(load_args)
    agent = config.agent.model_copy(update={"search": SearchSection(top_k=1, max_chars_per_passage=120)})
    cfg = RolloutSection(n=4, initial_rollouts=2, beam_size=2, branch_probability=0.5, entropy_weight=0.2,
                         call_limit=2, max_prompt_length=1024, max_response_length=112, temperature=1.0,
                         entropy_tokens=8)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-schedule-") as cache, \
            ToolBox.from_config(agent, str(data.file("corpus")), cache) as box:
        for median in [float(m) for m in args.medians.split(",")]:
            walls, batches = {}, {}
            for schedule in SCHEDULES:
                tools = SlowedToolBox(box, LatencyTools(median))   # real seconds: the model's decode time is real
                driver = TreeRollout(load_backend("transformers", model, tok), tools, tok,
                                     cfg.model_copy(update={"schedule": schedule}), "arpo", show_progress=False)
                start = time.perf_counter()
                batch = driver.rollout(prompts, seed=7)
                walls[schedule] = time.perf_counter() - start
                batches[schedule] = [dataclasses.asdict(t) for t in batch.trajectories]
                calls = batch.metrics["tool_calls_executed"]
                rows.append([median, schedule, round(walls[schedule], 2), round(walls[schedule] / walls["rounds"], 3),
                             calls])
                print(f"tiny model, median {median:g} s {schedule:12s} {walls[schedule]:6.1f} s"
                      f"  ratio {rows[-1][3]:.3f}  calls {calls:.0f}")
            if batches["early_tools"] != batches["rounds"]:
                raise SystemExit(f"tiny model, median {median} s: the schedules gave different batches")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", type=int, default=6)
    p.add_argument("--medians", default="0.5,1.5,4")
    p.add_argument("--time-scale", type=float, default=0.1)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--initial", type=int, default=4)
    p.add_argument("--step-trees", type=int, default=6, help="trees in one rollout call for the async section")
    p.add_argument("--tiny", action="store_true", help="also the tiny model (transformers backend)")
    p.add_argument("--tiny-prompts", type=int, default=2)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    cfg = RolloutSection(n=args.n, initial_rollouts=args.initial, beam_size=2, branch_probability=0.5,
                         entropy_weight=0.2, call_limit=MAX_SEARCHES, max_prompt_length=64,
                         max_response_length=2000, entropy_tokens=20, entropy_quantity="surprisal")
    table, figures = [], {}
    for median in [float(m) for m in args.medians.split(",")]:
        walls, models, batches, calls = {}, {}, {}, {}
        for schedule in SCHEDULES:
            out = [run_tree(schedule, tree, median, args.time_scale, cfg) for tree in range(args.trees)]
            walls[schedule], models[schedule] = [o[0] for o in out], [o[1] for o in out]
            batches[schedule] = [o[2] for o in out]
            calls[schedule] = sum(o[3]["tool_calls_executed"] for o in out) / args.trees
        if batches["early_tools"] != batches["rounds"]:
            raise SystemExit(f"median {median} s: the schedules grew different trees; the parity is broken")
        base = sum(walls["rounds"])
        for schedule in SCHEDULES:
            wall, model = sum(walls[schedule]), sum(models[schedule])
            tail = max(walls[schedule]) / (wall / args.trees)
            table.append([median, schedule, round(wall / args.trees / args.time_scale, 2),
                          round(wall / base, 3), round(model / sum(models["rounds"]), 3), round(wall / model, 3),
                          round(tail, 2), round(calls[schedule], 2)])
            key = f"{schedule}_m{median:g}".replace(".", "_")
            figures[f"{key}_ratio"], figures[f"{key}_measured_over_model"] = table[-1][3], table[-1][5]
            print(f"median {median:g} s {schedule:12s} tree {table[-1][2]:6.2f} s (unscaled)  ratio {table[-1][3]:.3f}"
                  f"  model ratio {table[-1][4]:.3f}  measured/model {table[-1][5]:.3f}  tail {tail:.2f}")
    step_rows = step_bench(args, cfg)
    figures["step_trees"] = args.step_trees
    for median, schedule, _, ratio, _, over in step_rows:
        key = f"step_{schedule}_m{median:g}".replace(".", "_")
        figures[f"{key}_ratio"], figures[f"{key}_measured_over_model"] = ratio, over
    tiny_rows = tiny_bench(args) if args.tiny else []
    for median, schedule, _, ratio, _ in tiny_rows:
        figures[f"tiny_{schedule}_m{median:g}_ratio".replace(".", "_")] = ratio
    if args.no_write:
        return
    write_result(
        "rollout_schedule", figures,
        summary="early_tools / rounds rollout wall time, scripted server: {early_tools_m0_5_ratio:.2f} (tool median "
                "0.5 s), {early_tools_m1_5_ratio:.2f} (1.5 s), {early_tools_m4_ratio:.2f} (4 s); measured / "
                "critical-path model {rounds_m1_5_measured_over_model:.2f} (rounds), "
                "{early_tools_m1_5_measured_over_model:.2f} (early_tools) at 1.5 s; async / rounds, "
                "{step_trees} trees in one call: {step_async_m0_5_ratio:.2f}, {step_async_m1_5_ratio:.2f}, "
                "{step_async_m4_ratio:.2f}"
                + ("; tiny model (transformers) {tiny_early_tools_m1_5_ratio:.2f} at 1.5 s" if tiny_rows else ""),
        what="rollout wall time per rl.rollout.schedule with lognormal tool latency (scripted server, ARPO trees)",
        command="bench/bench_rollout_schedule.py",
        details="rollout.md#schedules-rlrolloutschedule",
        conditions={**{k: v for k, v in vars(args).items() if k != "no_write"}, "sigma": SIGMA, "p_call": P_CALL,
                    "max_searches": MAX_SEARCHES, "first_ms": 20, "token_ms": 2, "algorithm": "arpo"},
        tables={"rows": {"columns": ["tool median s", "schedule", "s per tree (unscaled)", "wall / rounds",
                                     "model / rounds", "measured / model", "slowest / mean tree",
                                     "calls run per tree"], "rows": table},
                "step": {"columns": ["tool median s", "schedule", "s per step (unscaled)", "wall / rounds",
                                     "model / rounds", "measured / model"], "rows": step_rows},
                **({"tiny": {"columns": ["tool median s", "schedule", "rollout s", "wall / rounds", "calls run"],
                             "rows": tiny_rows}} if tiny_rows else {})})


if __name__ == "__main__":
    main()
