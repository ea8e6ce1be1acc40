"""Secrets from Prefect blocks, handed to stages through the environment (stages/ never imports Prefect).

The web search key lives in an environment variable (`agent.search.web.api_key_env`); when that is unset and
`agent.search.web.secret_block` names a Prefect Secret block, the task reads the block and exports the key
for the stage it is about to run (and for a stage run under another interpreter, which inherits it). The Jina
Reader's key (`agent.search.browse.jina_api_key_env` / `jina_secret_block`, with `browse.reader: jina`) is exported
the same way. The python sandbox gets a minimal environment of its own, so the keys never reach model-written code.
"""

from __future__ import annotations

import os

from stages.agent.search.base import SearchError
from stages.core.config.agent import AgentSection


def export_search_key(agent: AgentSection) -> None:
    web, browse = agent.search.web, agent.search.browse
    if agent.search.backend == "web":
        _export(web.api_key_env, web.secret_block, "web search")
    if browse.reader == "jina":
        _export(browse.jina_api_key_env, browse.jina_secret_block, "the Jina Reader (agent.search.browse.reader=jina)")


def _export(env: str, block: str | None, what: str) -> None:
    if not block or os.environ.get(env, "").strip():
        return
    from prefect.blocks.system import Secret

    try:
        key = str(Secret.load(block).get()).strip()
    except Exception as err:
        raise SearchError(f"{what}: environment variable {env} is unset and the Prefect Secret block {block!r} could "
                          f"not be read ({err}); create it with `prefect block create secret` or export {env}") from err
    if key:
        os.environ[env] = key
