from __future__ import annotations

from typing import Literal

from pydantic import Field

from stages.core.config.section import Section


class PythonToolSection(Section):
    """Limits of the python sandbox that runs model-written code."""

    sandbox: Literal["auto", "bwrap", "rlimit"] = Field("auto", description="auto = bubblewrap when installed")
    timeout_s: float = Field(10.0, gt=0, description="wall-clock limit per call")
    cpu_s: int = Field(10, gt=0)
    memory_mb: int = Field(1024, gt=0)
    max_processes: int = Field(32, gt=0)
    max_file_mb: int = Field(16, gt=0)
    max_open_files: int = Field(64, gt=0)
    max_output_chars: int = Field(4000, gt=0)
    pool_size: int = Field(2, ge=0, description="pre-started interpreters; 0 = cold start per call")


class WebSearchSection(Section):
    provider: Literal["brightdata"] = "brightdata"
    endpoint: str = "https://api.brightdata.com/request"
    api_key_env: str = Field("BRIGHTDATA_API_KEY", description="environment variable holding the key")
    secret_block: str | None = Field(None, description="Prefect Secret block name, tried when the env var is unset")
    zone: str = "serp_api1"
    requests_per_second: float = 2.0
    retries: int = 3
    timeout_s: float = 60.0


class SearchSection(Section):
    backend: Literal["local", "server", "web", "replay"] = "local"
    top_k: int = Field(5, ge=1)
    max_chars_per_passage: int = Field(1000, ge=1)
    corpus_path: str | None = Field(None, description="FlashRAG JSONL; None = the generated corpus")
    server_url: str | None = Field(None, description="retrieval server base URL (backend=server)")
    replay_path: str | None = Field(None, description="{query: result} JSON (backend=replay)")
    web: WebSearchSection = WebSearchSection()


class ToolLimitsSection(Section):
    max_calls: int = Field(5, ge=0, description="total tool calls per trajectory")
    max_python: int | None = Field(None, ge=0, description="per-tool cap; None = only the total applies")
    max_search: int | None = Field(None, ge=0)


class ToolCacheSection(Section):
    enabled: bool = True
    path: str | None = Field(None, description="SQLite file; None = <cache_root>/tool_cache.sqlite")


class AgentSection(Section):
    """The tool-integrated reasoning protocol shared by RL rollouts and evaluation."""

    prompt_template: str = Field("tir_search_python", description="file stem under configs/templates/")
    python: PythonToolSection = PythonToolSection()
    search: SearchSection = SearchSection()
    limits: ToolLimitsSection = ToolLimitsSection()
    cache: ToolCacheSection = ToolCacheSection()
