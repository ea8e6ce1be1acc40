"""How much the reference's branching rules change a rollout tree: a Monte-Carlo over the pure rules of
stages/rl/branching.py (no model), comparing each rule with the reading it replaced.

Model of a group (stated, not measured on a policy): every active trajectory makes a tool call each round with
probability `--p-call` (up to `--call-limit` calls) and otherwise ends; after a call it is a branch candidate
with dH ~ N(0, `--sigma`) (dH = 0 at its first decision, as the reference window gives). Budget n, initial roots,
beam, tau, w and AEPO's penalty p as the published AEPO script (n 16 / 8 roots as the 7B script). Fresh roots:
one per round when a group has no active trajectory (the reference).

Counters compared: `consecutive` (the reference per prompt: rounds in a row that added trajectories; this
project's default), `batch` (the reference exactly: counters move only in rounds in which some prompt of the
rollout batch added one), `copies` (the earlier reading: copies made this rollout, same round included).
Draws compared at beam 3: `fixed` (the reference: min(beam - 1, budget left) draws per candidate) and `until_full`
(the earlier rule: up to beam - 1 draws, stopping when the budget is full).

    .venv/bin/python bench/bench_branch_rules.py --groups 4000
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import write_result
from stages.rl.branching import aepo_should_branch, choose_branches, consecutive_rounds, fresh_to_add


@dataclass
class Group:
    n: int
    active: list[tuple[int, int]]     # per active trajectory: (tool calls made, branch decisions seen)
    created: int
    c: int = 0
    copies: int = 0
    fresh: int = 0


def until_full(cands, remaining, beam, decide):
    """The earlier rule: up to beam - 1 draws per candidate, stopping once the budget is full."""
    parents = []
    for traj, dh in cands:
        for _ in range(beam - 1):
            if len(parents) >= remaining:
                return parents
            if decide(dh, len(parents)):
                parents.append(traj)
    return parents


def one_round(args, g: Group, counter: str, draws: str, rng: random.Random) -> int:
    """Calls, branching and fresh roots of one group's round; returns the trajectories it added."""
    g.active = [(calls + 1, seen) for calls, seen in g.active
                if calls < args.call_limit and rng.random() < args.p_call]
    # a trajectory's first decision sees dH = 0 (its first segment is its baseline; copies take their own)
    cands = [(i, 0.0 if seen == 0 else rng.gauss(0, args.sigma)) for i, (_, seen) in enumerate(g.active)]
    c_of = (lambda planned: g.copies + planned) if counter == "copies" else (lambda planned: g.c)
    decide = lambda dh, planned: aepo_should_branch(rng.random(), args.tau, args.w, dh, c_of(planned),  # noqa: E731
                                                    args.penalty)
    parents = (choose_branches if draws == "fixed" else until_full)(cands, g.n - g.created, args.beam, decide)
    g.active = [(calls, seen + 1) for calls, seen in g.active] + [(g.active[p][0], 0) for p in parents]
    extra = fresh_to_add(g.n, g.created + len(parents), len(g.active), "one")
    g.active += [(0, 0)] * extra
    g.created += len(parents) + extra
    g.copies += len(parents)
    g.fresh += extra
    return len(parents) + extra


def simulate(args, counter: str, draws: str, rng: random.Random) -> tuple[float, float]:
    copies = fresh = 0
    batches = args.groups // args.batch
    for _ in range(batches):
        groups = [Group(args.n, [(0, 0)] * args.initial, args.initial) for _ in range(args.batch)]
        while any(g.active for g in groups):
            added = [one_round(args, g, counter, draws, rng) for g in groups]
            if counter == "consecutive" or (counter == "batch" and any(added)):
                for g, a in zip(groups, added):
                    g.c = consecutive_rounds(g.c, a)
        copies += sum(g.copies for g in groups)
        fresh += sum(g.fresh for g in groups)
    return copies / (batches * args.batch), fresh / (batches * args.batch)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=4000)
    p.add_argument("--batch", type=int, default=8, help="prompts per rollout batch (the reference's counters)")
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--initial", type=int, default=8)
    p.add_argument("--call-limit", type=int, default=6)
    p.add_argument("--p-call", type=float, default=0.7)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--tau", type=float, default=0.5)
    p.add_argument("--w", type=float, default=0.2)
    p.add_argument("--penalty", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(f"n={args.n} initial={args.initial} call_limit={args.call_limit} p_call={args.p_call} "
          f"sigma={args.sigma} tau={args.tau} w={args.w} penalty={args.penalty}, {args.groups} groups")
    print("| beam | draws | counter | copies / group | fresh roots / group |\n|---|---|---|---|---|")
    rows = []
    for beam, draws, counter in [(2, "fixed", "consecutive"), (2, "fixed", "batch"), (2, "fixed", "copies"),
                                 (3, "fixed", "consecutive"), (3, "until_full", "consecutive")]:
        args.beam = beam
        copies, fresh = simulate(args, counter, draws, random.Random(args.seed))
        print(f"| {beam} | {draws} | {counter} | {copies:.2f} | {fresh:.2f} |")
        rows.append([beam, draws, counter, round(copies, 3), round(fresh, 3)])
    copies = {f"beam{beam}_{draws}_{counter}": c for beam, draws, counter, c, _ in rows}
    write_result("branch_rules", copies,
                 summary="copies per group, beam 2: consecutive counter (the default) {beam2_fixed_consecutive:.2f}, "
                         "the reference's batch counter {beam2_fixed_batch:.2f}, the copies reading "
                         "{beam2_fixed_copies:.2f}; beam 3: fixed draws {beam3_fixed_consecutive:.2f} vs "
                         "draw-until-full {beam3_until_full_consecutive:.2f}",
                 what="the reference's branching rules vs the readings they replaced (a Monte-Carlo over the pure "
                      "rules, stated trajectory model)",
                 command="bench/bench_branch_rules.py", details="reference.md#penalty-counter",
                 conditions={k: v for k, v in vars(args).items() if k != "beam"},
                 tables={"rows": {"columns": ["beam", "draws", "counter", "copies / group", "fresh roots / group"],
                                  "rows": rows}})


if __name__ == "__main__":
    main()
