"""`arpo`: the front door. Run the pipeline (or part of it), inspect configs, manage the local Prefect UI.

Config errors are reported before Prefect is even imported; exit code 2 means "fix your input" (a bad
config, a missing or malformed data file: `stages.core.errors.InputError`, printed as its message only); exit
code 3 means the Prefect server the run reports to stopped answering (finished stages stay cached: rerun).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import sys
from pathlib import Path

from flows import extra_commands, rehearse_commands
from flows.automations import CRASH_AFTER_S
from flows.launch import ServerLost, run_pipeline
from flows.server import default_port, start_prefect_server
from stages.core.env import configure_environment

# The last exit hook (registered first, run last): after Prefect's log and event flush and the temporary server's
# stop, the interpreter's final garbage collection would walk everything Prefect and mlflow loaded, 0.8-1.0 s of
# CPU on the 2-core box (docs/benchmarks.md, the tiny chain); frozen objects are left to the OS, which frees them
# at once.
atexit.register(gc.freeze)


def main(argv: list[str] | None = None) -> int:
    configure_environment()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        parser.print_help()
        return 2
    from stages.core.errors import InputError
    from stages.core.selection import SelectionError

    try:
        return args.handler(args) or 0
    except (InputError, SelectionError) as err:  # bad config or data: the message says what to fix, no traceback
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ServerLost as err:
        print(f"error: {err}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)  # Prefect's exit hooks would keep retrying the gone server for minutes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arpo", description=__doc__)
    sub = parser.add_subparsers()
    run = sub.add_parser("run", help="run the pipeline (default: the whole tiny chain on CPU)")
    _config_args(run)
    _stage_args(run)
    run.set_defaults(handler=cmd_run)
    rehearse_commands.register(sub, _config_args, _stage_args)

    config = sub.add_parser("config", help="show or validate the resolved config")
    config.add_argument("action", choices=["show", "validate"])
    config.add_argument("--card", action="store_true",
                        help="show the RL algorithm card instead: each mechanism, this run vs the reference code (and the "
                             "rest of the published recipe where one is on file: stages/core/recipes.py)")
    config.add_argument("--diff", action="store_true",
                        help="show only what the profile (and -o) changes: each key that differs from the defaults, "
                             "its default and where the value comes from (the profile, one it extends, -o, or "
                             "implied by another key), then any key the profile restates")
    _config_args(config)
    config.set_defaults(handler=cmd_config)

    server = sub.add_parser("server", help=f"the local Prefect server (web UI at http://127.0.0.1:{default_port()})")
    server.add_argument("action", choices=["start", "stop", "status"])
    server.add_argument("--port", type=int, default=None,
                        help=f"default: the port of prefect.toml's api.url ({default_port()})")
    server.add_argument("--crash-after", type=int, default=None, metavar="SECONDS",
                        help=f"mark a flow run Crashed after this long without a heartbeat (default "
                             f"{CRASH_AFTER_S}; 0 = never)")
    server.set_defaults(handler=cmd_server)

    cost_plan = sub.add_parser("plan", help="what a run will cost before it starts: prompts, tokens, tool and search "
                          "calls per step and per run, search price, device-hours (docs/plan.md)")
    _config_args(cost_plan)
    cost_plan.add_argument("--json", action="store_true", help="print the estimate as JSON")
    cost_plan.set_defaults(handler=cmd_plan)

    stages = sub.add_parser("stages", help="list the pipeline stages in order")
    stages.set_defaults(handler=cmd_stages)
    extra_commands.register(sub)
    return parser


def _stage_args(parser: argparse.ArgumentParser) -> None:
    """Which stages run (arpo run, arpo rehearse)."""
    parser.add_argument("--only", action="append", default=[], metavar="STAGE",
                        help="run just this stage (upstream inputs come from cache); repeatable")
    parser.add_argument("--until", metavar="STAGE", help="run the chain up to and including STAGE")
    parser.add_argument("--refresh", action="append", default=[], metavar="STAGE",
                        help="recompute STAGE even if cached (its downstream follows); repeatable")
    parser.add_argument("--from", dest="refresh_from", metavar="STAGE", help="recompute STAGE and everything after it")
    parser.add_argument("--ephemeral", action="store_true",
                        help="do not use the local Prefect server even if it is running")
    parser.add_argument("--verify", action="store_true",
                        help="check every byte of each cached output against its manifest before reusing it (default: "
                             "sizes, and contents of small or touched files)")


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-p", "--profile", default="tiny-cpu", help="configs/profiles/<PROFILE>.yaml or a path")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config value, e.g. -o rl.rollout.n=8; repeatable")


def cmd_stages(args: argparse.Namespace) -> int:
    from stages.core.stage_spec import table

    stages = table()
    print(" -> ".join(stages.stages))
    print("groups: " + ", ".join(f"{name} = {'+'.join(members)}" for name, members in stages.groups.items()))
    for spec in stages.specs:  # what each stage reads and where it runs, off the table (stages/core/stage_spec.py)
        notes = [f"part of {spec.part_of}" if spec.part_of else "", f"group {spec.group}" if spec.group else "",
                 "may run under another interpreter" if spec.isolatable else ""]
        print(f"  {spec.name:<10} reads {', '.join(spec.sections):<20} {spec.entry}"
              + "".join(f"; {n}" for n in notes if n))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from stages.core.config.loader import load_config, to_yaml

    cfg = load_config(args.profile, args.override)
    if args.card:
        from stages.core.recipes import recipe_for, recipe_markdown
        from stages.rl.card import algorithm_card, card_markdown

        print(card_markdown(algorithm_card(cfg.rl, cfg.agent)))
        recipe = recipe_for(cfg.rl.reference_setting)   # the rest of a published recipe (SFT, DPO, evaluation)
        if recipe is not None:
            print(recipe_markdown(cfg, recipe))
        return 0
    if args.diff:
        from stages.core.config.profile_diff import diff_text

        print(diff_text(args.profile, args.override))
        return 0
    print(to_yaml(cfg) if args.action == "show" else f"ok: profile {cfg.profile} is valid")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from stages.core.config.loader import load_config
    from stages.cost import plan_run, render_markdown

    estimate = plan_run(load_config(args.profile, args.override))
    print(json.dumps(estimate.to_json(), indent=2) if args.json else render_markdown(estimate))
    return 0


def cmd_server(args: argparse.Namespace) -> int:
    from stages.core import services

    url = f"http://127.0.0.1:{args.port or default_port()}"
    if args.action == "start":
        service = start_prefect_server(args.port, args.crash_after)
        print(f"Prefect UI: {service.url}   (log: {service.log}; stop with `arpo server stop`)")
    elif args.action == "stop":
        print("stopped" if services.stop("prefect-server") else "not running")
    else:
        service = services.load("prefect-server")
        print(f"running at {service.url} (pid {service.pid})" if service else f"not running ({url})")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    summary = run_pipeline(args.profile, args.override, args)
    report = summary["refs"].get("report")
    if report:
        print(f"report:     {report['path']}")
        print_parity(Path(report["path"]) / "report.md")
    return 0


def print_parity(markdown: Path) -> None:
    """A parity profile's table (the report's "Paper parity" section, stages/eval/parity.py), on the terminal."""
    from stages.eval.parity import parity_section

    section = parity_section(markdown.read_text(encoding="utf-8")) if markdown.is_file() else ""
    if section:
        print("\n" + section)


if __name__ == "__main__":
    raise SystemExit(main())
