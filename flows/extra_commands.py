"""Subcommands owned by other rooms (retriever server, deployments), registered onto the `arpo` parser."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    retriever = sub.add_parser("retriever", help="serve a local search index on the FlashRAG HTTP API")
    retriever.add_argument("action", choices=["serve"])
    retriever.add_argument("rest", nargs=argparse.REMAINDER, help="options of the retriever server (see --help)")
    retriever.set_defaults(handler=cmd_retriever)


def cmd_retriever(args: argparse.Namespace) -> int:
    from stages.agent.retriever_server import main

    return main(args.rest) or 0
