"""`arpo rehearse -p PROFILE`: the profile end to end at toy scale on this box (docs/rehearse.md).

The profile's config plus the rehearsal rule's changes (stages/rehearse/rule.py), printed before anything runs;
the checks that need no training (stages/rehearse/run.py: prepare); then the same pipeline as `arpo run`; then
`rehearsal.md` / `rehearsal.json` in the run record.
"""

from __future__ import annotations

import argparse

from stages.core.engine_spec import ENGINES  # the engine table (pure data: nothing heavy before the pre-flight)


def register(sub: argparse._SubParsersAction, config_args, stage_args) -> None:
    rehearse = sub.add_parser("rehearse", help="run a profile end to end at toy scale on this box (a random-init "
                              "model of its architecture with its real tokenizer; docs/rehearse.md)")
    config_args(rehearse)
    stage_args(rehearse)
    rehearse.add_argument("--search-replay", metavar="JSON", help="recorded {query: result} search results that "
                          "stand in for web search (needed when the profile searches the web)")
    rehearse.add_argument("--page-replay", metavar="JSON", help="recorded {url: text} pages that stand in for "
                          "browsing (without it, browsing is off in the rehearsal)")
    rehearse.add_argument("--engine", choices=ENGINES.ordered(), help="rehearse on this RL engine instead of the "
                          "profile's (recorded as a swap)")
    rehearse.add_argument("--judge", choices=["rule", "policy"], default="rule", help="rule: score with rule "
                          "metrics only (default); policy: the served toy policy stands in for the profile's judge, "
                          "so the judge's path runs (its verdicts are noise)")
    rehearse.add_argument("--toy-policy", choices=["random", "tool_caller"], default="random", help="random: a "
                          "random-init toy (it never calls a tool); tool_caller: weights planted to call the python "
                          "and search tools, so the RL steps run real tool calls and branch after them "
                          "(model.toy_policy, stages/bootstrap/toy_policy.py)")
    rehearse.add_argument("--dry-run", action="store_true", help="print the changes, build the toy model and run the "
                          "seam checks; train nothing")
    rehearse.set_defaults(handler=cmd_rehearse)


def cmd_rehearse(args: argparse.Namespace) -> int:
    from flows.launch import run_pipeline
    from stages.core.selection import select_stages
    from stages.rehearse.rule import Offline
    from stages.rehearse.run import finish, prepare

    selection = select_stages(args.only, args.until, args.refresh, args.refresh_from)
    offline = Offline(args.search_replay, args.page_replay, args.engine, args.judge, args.toy_policy)
    prepared = prepare(args.profile, args.override, offline, selection.run, announce=show)
    print("seam checks: " + ("; ".join(f"{r.name} ok" for r in prepared.seams) if prepared.seams else "not run"))
    if args.dry_run:
        return 0
    summary = run_pipeline(args.profile, prepared.overrides, args, cfg=prepared.cfg)
    print(f"rehearsal:  {finish(prepared, summary)}")
    return 0


def show(prepared) -> None:
    print(f"Rehearsal of {prepared.rehearsal.profile}: {len(prepared.rehearsal.changes)} changes "
          "(stages/rehearse/rule.py)\n")
    print(prepared.rehearsal.table() + "\n")
    for key, value in prepared.at_scale.items():
        print(f"at the real scale, {key}: {value}")
