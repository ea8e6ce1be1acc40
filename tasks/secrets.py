"""Secrets from Prefect blocks, handed to stages through the environment (stages/ never imports Prefect).

The web search key lives in an environment variable (`agent.search.web.api_key_env`); when that is unset and
`agent.search.web.secret_block` names a Prefect Secret block, the task reads the block and exports the key
for the stage it is about to run (and for a stage run under another interpreter, which inherits it). The
python sandbox gets a minimal environment of its own, so the key never reaches model-written code.
"""

from __future__ import annotations

import os

from stages.agent.search.base import SearchError
from stages.core.config.agent import AgentSection


def export_search_key(agent: AgentSection) -> None:
    web = agent.search.web
    if agent.search.backend != "web" or not web.secret_block or os.environ.get(web.api_key_env, "").strip():
        return
    from prefect.blocks.system import Secret

    try:
        key = str(Secret.load(web.secret_block).get()).strip()
    except Exception as err:
        raise SearchError(f"web search: environment variable {web.api_key_env} is unset and the Prefect Secret "
                          f"block {web.secret_block!r} could not be read ({err}); create it with "
                          f"`prefect block create secret` or export {web.api_key_env}") from err
    if key:
        os.environ[web.api_key_env] = key
