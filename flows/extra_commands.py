"""Subcommands owned by other rooms (retriever server, FSDP merge, rollout trees, deployments), registered onto the
`arpo` parser."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from flows import generated_docs

    register_deploy(sub)
    generated_docs.register(sub)
    retriever = sub.add_parser("retriever", help="serve a local search index on the FlashRAG HTTP API")
    retriever.add_argument("action", choices=["serve"])
    retriever.add_argument("rest", nargs=argparse.REMAINDER, help="options of the retriever server (see --help)")
    retriever.set_defaults(handler=cmd_retriever)
    fsdp = sub.add_parser("merge-fsdp", help="merge a verl FSDP actor checkpoint into a safetensors HF folder")
    fsdp.add_argument("actor_dir", help="verl's global_step_N/actor folder (model_world_size_*_rank_*.pt)")
    fsdp.add_argument("out_dir", help="the HF folder to write (atomically)")
    fsdp.add_argument("--config-dir", help="folder with config.json + tokenizer (default: <actor_dir>/huggingface)")
    fsdp.set_defaults(handler=cmd_merge_fsdp)
    trees = sub.add_parser("trees", help="an RL run's ARPO/AEPO rollout trees as text: per-step tree statistics, then "
                                         "one step's trees (docs/ui.md, Rollout trees)")
    trees.add_argument("run", nargs="?", default="latest",
                       help="a run (outputs/runs/<name>, its name, latest) or an RL stage folder (default: latest)")
    trees.add_argument("--step", type=int, help="the dumped step to show (default: the newest)")
    trees.add_argument("--group", help="only this group (its id as printed)")
    trees.add_argument("--output-root", default="outputs", help="where run names are looked up (run.output_root)")
    trees.add_argument("--html", metavar="DIR", help="also write every step's tree page into DIR")
    trees.set_defaults(handler=cmd_trees)


def cmd_retriever(args: argparse.Namespace) -> int:
    from stages.agent.retriever_server import main

    return main(args.rest) or 0


def cmd_trees(args: argparse.Namespace) -> int:
    from stages.rl.tree_report import trees_report

    print(trees_report(args.run, args.step, args.group, args.output_root, args.html), end="")
    return 0


def cmd_merge_fsdp(args: argparse.Namespace) -> int:
    from stages.rl.fsdp_merge import merge_fsdp_shards

    print(merge_fsdp_shards(args.actor_dir, args.out_dir, args.config_dir))
    return 0


def register_deploy(sub: argparse._SubParsersAction) -> None:
    deploy = sub.add_parser("deploy", help="start the local server, create work pools, register prefect.yaml "
                                           "deployments and start a worker")
    deploy.add_argument("--pool", default="arpo-cpu", help="work pool the started worker serves")
    deploy.add_argument("--no-worker", action="store_true", help="register only; start workers yourself")
    deploy.set_defaults(handler=cmd_deploy)
    worker = sub.add_parser("worker", help="a Prefect process worker for a work pool (start/stop/status)")
    worker.add_argument("action", choices=["start", "stop", "status"])
    worker.add_argument("--pool", default="arpo-cpu")
    worker.set_defaults(handler=cmd_worker)


def cmd_deploy(args: argparse.Namespace) -> int:
    from flows.deployments import create_work_pools, register_deployments
    from flows.server import start_prefect_server, use_local_server_if_running

    start_prefect_server()
    url = use_local_server_if_running()
    create_work_pools()
    names = register_deployments()
    print(f"registered {len(names)} deployments on {url}: {', '.join(names)}")
    if not args.no_worker:
        return cmd_worker(argparse.Namespace(action="start", pool=args.pool))
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from flows.deployments import start_worker
    from flows.server import use_local_server_if_running
    from stages.core import services

    name = f"worker-{args.pool}"
    if args.action == "start":
        if not use_local_server_if_running():
            print("error: no Prefect server; run `arpo server start` (or `arpo deploy`) first")
            return 2
        service = start_worker(args.pool)
        print(f"worker for pool {args.pool} running (pid {service.pid}, log {service.log})")
    elif args.action == "stop":
        print("stopped" if services.stop(name) else "not running")
    else:
        service = services.load(name)
        print(f"running (pid {service.pid})" if service else "not running")
    return 0
