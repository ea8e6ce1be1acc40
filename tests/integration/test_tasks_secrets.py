"""The web search key from a real Prefect Secret block, exported by the task layer for the stage it runs."""

from __future__ import annotations

import pytest

from stages.agent.search.base import SearchError
from stages.agent.search.web import resolve_api_key
from stages.core.config.agent import AgentSection
from tasks.secrets import export_search_key

pytestmark = pytest.mark.integration
VAR = "ARPO_TEST_SEARCH_KEY"


def agent_with(backend: str, block: str | None) -> AgentSection:
    return AgentSection.model_validate({"search": {"backend": backend, "web": {"api_key_env": VAR,
                                                                              "secret_block": block}}})


def test_secret_block_reaches_the_stage_through_the_environment(prefect_harness, monkeypatch) -> None:
    from prefect.blocks.system import Secret

    Secret(value="key-from-block").save("arpo-test-search-key", overwrite=True)
    monkeypatch.delenv(VAR, raising=False)
    export_search_key(agent_with("local", "arpo-test-search-key"))   # no web search: the block is not read
    with pytest.raises(SearchError, match=f"export {VAR}"):
        resolve_api_key(agent_with("web", None).search.web)
    export_search_key(agent_with("web", "arpo-test-search-key"))
    assert resolve_api_key(agent_with("web", None).search.web) == "key-from-block"
    monkeypatch.setenv(VAR, "key-from-env")                          # an exported key wins over the block
    export_search_key(agent_with("web", "arpo-test-search-key"))
    assert resolve_api_key(agent_with("web", None).search.web) == "key-from-env"


def test_missing_block_is_a_clear_error(prefect_harness, monkeypatch) -> None:
    monkeypatch.delenv(VAR, raising=False)
    with pytest.raises(SearchError, match="'no-such-block' could not be read.*prefect block create secret"):
        export_search_key(agent_with("web", "no-such-block"))
