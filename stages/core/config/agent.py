from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from stages.core.config.browse import BrowseSection, SummarizerSection
from stages.core.config.section import Section, registry, used_when
from stages.core.input_files import input_file


class PythonToolSection(Section):
    """Limits of the python sandbox that runs model-written code (stages/agent/sandbox/executor.py)."""

    sandbox: Literal["auto", "bwrap", "rlimit"] = Field(
        "auto", description="auto/bwrap = bubblewrap; when it cannot run, the sandbox stops with the reason and "
        "the fix (never a silent fallback). rlimit = the weaker mode without namespaces, only by this explicit "
        "choice (docs/agent.md lists what it does not contain)")
    python_executable: str | None = Field(
        None, description="interpreter that runs the code (needs numpy and sympy); None = the pipeline's own",
        json_schema_extra=input_file("executable"))
    preload: list[str] = Field(
        default_factory=lambda: ["numpy", "sympy"],
        description="modules imported before the code arrives (warm interpreters); imports of them are free")
    timeout_s: float = Field(10.0, gt=0, description="wall-clock limit per call")
    startup_timeout_s: float = Field(60.0, gt=0, description="wait for the warm parent to finish its preloads")
    cpu_s: int = Field(10, gt=0, description="CPU seconds for the code (RLIMIT_CPU, beyond the preloads)")
    memory_mb: int = Field(1024, gt=0, description="address space for the code (RLIMIT_AS, beyond the preloads)")
    max_processes: int = Field(32, gt=0, description="processes+threads (RLIMIT_NPROC, counted per sandbox)")
    max_file_mb: int = Field(16, gt=0, description="largest file the code may write, stdout included")
    max_open_files: int = Field(64, gt=0, description="file descriptors the code may hold open (RLIMIT_NOFILE)")
    workdir_mb: int = Field(64, gt=0, description="size of each call's tmpfs working dir, /tmp and /dev/shm (bwrap)")
    max_output_chars: int = Field(4000, gt=0, description="stdout/stderr kept per call (head and tail)")
    max_code_chars: int = Field(100_000, gt=0, description="longer code is refused without running")
    seed: int | None = Field(
        None, description="None = every call starts its random generators (random, numpy) from fresh entropy, as "
        "a new interpreter would; an int = every call starts them, and str hashing, from this seed, so the same "
        "code prints the same output on every run (required to cache python results: agent.cache.tools)")
    uid_base: int = Field(
        1_800_000_000, ge=1000,
        description="when the pipeline runs as root, each call runs as its own uid in [uid_base, uid_base+100000), "
        "never used by two calls at once on the machine")


class WebSearchSection(Section):
    """Bing-compatible SERP API (Bright Data by default, as the reference)."""

    provider: Literal["brightdata"] = Field("brightdata", description="the SERP API's provider (one so far); it "
                                            "names the shared rate-limit file and the results' corpus id")
    endpoint: str = Field("https://api.brightdata.com/request", description="the provider's request API, POSTed "
                          "with the zone and the SERP page URL")
    api_key_env: str = Field("BRIGHTDATA_API_KEY", description="environment variable holding the key")
    secret_block: str | None = Field(None, description="Prefect Secret block name, tried when the env var is unset")
    zone: str = Field("serp_api1", description="Bright Data zone of the SERP API")
    search_url: str = Field("https://www.bing.com/search", description="SERP page Bright Data fetches")
    market: str = Field("en-US", description="Bing mkt; setLang is its language part")
    country: str = Field("us", description="Bright Data cc (country of the exit node)")
    requests_per_second: float = Field(2.0, gt=0, description="queries per second, one limit for every process "
                                       "that shares the cache root (<cache_root>/rate-limits/)")
    retries: int = Field(3, ge=1, description="attempts per query (exponential backoff on errors and 429/5xx)")
    timeout_s: float = Field(60.0, gt=0, description="HTTP timeout of one request to the provider")


class SearchSection(Section):
    """The search tool: which backend answers a query and how much of each result the model sees
    (stages/agent/search/, docs/agent.md)."""

    backend: str = Field("local", description="search backend: local (BM25 over a corpus) | server (a retrieval "
                         "server) | web (a SERP API) | replay (recorded results)",
                         json_schema_extra=registry("search backend"))
    top_k: int = Field(5, ge=1, description="results per query shown to the model (browsing reads browse.top_k "
                       "instead)")
    max_chars_per_passage: int = Field(1000, ge=1, description="characters kept of each result (whitespace "
                                       "squeezed), browsed passages included")
    corpus_path: str | None = Field(None, description="FlashRAG JSONL (backend=local); None = the generated corpus",
                                    json_schema_extra={**used_when(backend="local"), **input_file("jsonl")})
    server_url: str | None = Field(None, description="retrieval server base URL (backend=server)",
                                   json_schema_extra=used_when(backend="server"))
    server_timeout_s: float = Field(30.0, gt=0, description="HTTP timeout of the retrieval server client",
                                    json_schema_extra=used_when(backend="server"))
    replay_path: str | None = Field(None, description="{query: result} JSON (backend=replay)",
                                    json_schema_extra={**used_when(backend="replay"), **input_file("json_object")})
    web: WebSearchSection = WebSearchSection()
    browse: BrowseSection = BrowseSection()
    summarizer: SummarizerSection = SummarizerSection()

    @model_validator(mode="after")
    def _backend_needs(self) -> SearchSection:
        if self.backend == "server" and not self.server_url:
            raise ValueError("agent.search.backend=server needs agent.search.server_url (e.g. http://127.0.0.1:1243)")
        if self.backend == "replay" and not self.replay_path:
            raise ValueError("agent.search.backend=replay needs agent.search.replay_path (a {query: result} JSON such "
                             "as ../shared/data/search_cache.json)")
        if self.browse.enabled and self.browse.mode == "replay" and not self.browse.replay_path:
            raise ValueError("agent.search.browse.mode=replay needs agent.search.browse.replay_path (a {url: text} "
                             "JSON of recorded pages)")
        return self


class ToolLimitsSection(Section):
    """Tool calls a trajectory may make: a call over a limit gets a refusal as its result (stages/agent/toolbox.py);
    the evaluation sets its own per-tool limits (eval.max_python, eval.max_search)."""

    max_calls: int = Field(5, ge=0, description="total tool calls per trajectory")
    max_python: int | None = Field(None, ge=0, description="per-tool cap; None = only the total applies")
    max_search: int | None = Field(None, ge=0, description="per-tool cap of search calls; None = only the total "
                                   "applies")
    reject_repeated_queries: bool = Field(
        True, description="a search query already made in this trajectory gets a 'refer to previous results' note")

    def per_tool(self, tool: str) -> int | None:
        """The cap on calls to `tool` (None: only the total applies); each capped tool named once, here."""
        return {"python": self.max_python, "search": self.max_search}.get(tool)


class ToolCacheSection(Section):
    """A SQLite cache of tool results shared by every stage on the cache root (stages/agent/cache.py)."""

    enabled: bool = Field(True, description="reuse the cached result of the same call to a tool named in tools")
    path: str | None = Field(None, description="SQLite file; None = <cache_root>/tool_cache.sqlite")
    tools: list[str] = Field(
        default_factory=lambda: ["search"],
        json_schema_extra=registry("tool"),
        description="registered tools (stages/agent/tools.py) whose successful results are cached. python only "
        "with agent.python.seed set: without it, random/time outputs would repeat across trajectories and "
        "samples; even with it, code that reads the "
        "clock or the OS's entropy is replayed, so keep it off for RL and sampled evaluation")


class InferenceToolsSection(Section):
    """Tool-Star inference-time tools (docs/reference.md "Tool-Star's inference-time tools"); each needs an
    OpenAI-compatible helper LLM."""

    debugger: bool = Field(False, description="on a python error an LLM rewrites the code once and it reruns")
    rollback: bool = Field(False, description="on a python error cut back before the <python> and regenerate")
    refiner: bool = Field(False, description="compress the response when prompt+response pass the threshold")
    max_debug: int = Field(1, ge=0, description="debugger rewrites per sample")
    max_rollback: int = Field(1, ge=0, description="rollbacks per sample (Tool-Star: max_rollback_times 1)")
    max_refine: int = Field(1, ge=0, description="refinements per sample (Tool-Star: max_refine_times 1)")
    refine_threshold_tokens: int = Field(8192, ge=1, description="prompt + response tokens at which the refiner "
                                         "compresses the response (Tool-Star: 8192)")
    llm_url: str | None = Field(None, description="base URL of the helper LLM (…/v1); None = the served policy")
    llm_model: str | None = Field(None, description="model name at llm_url")
    api_key_env: str | None = Field(None, description="environment variable with the helper's key, if any")
    temperature: float = Field(0.0, ge=0, description="sampling temperature of the helper LLM's calls")
    max_tokens: int = Field(2048, ge=1, description="reply budget of one helper LLM call")
    timeout_s: float = Field(120.0, gt=0, description="HTTP timeout of one helper LLM call")


class AgentSection(Section):
    """The tool-integrated reasoning protocol shared by RL rollouts and evaluation."""

    prompt_template: str = Field("tir_search_python", description="file stem under configs/templates/",
                                 json_schema_extra=input_file("template"))
    python: PythonToolSection = PythonToolSection()
    search: SearchSection = SearchSection()
    limits: ToolLimitsSection = ToolLimitsSection()
    cache: ToolCacheSection = ToolCacheSection()
    inference: InferenceToolsSection = InferenceToolsSection()
    concurrency: int = Field(4, ge=1, description="threads of the tool pool of one process (ToolBox.execute_many): "
                             "tool calls run at once by one trainer, or by one agent-loop worker on verl (its trees "
                             "share the pool). The reference runs 64 per rollout worker (docs/agent.md, Tool pool)")
    tool_timeout_s: float | None = Field(
        600.0, gt=0, description="a tool call still running this long after it started is an infrastructure "
        "failure: its trajectory is masked and counted (tools/infra_failures); the stuck thread is abandoned and "
        "the pool replaced. Above the tools' own limits (python.timeout_s, search.web.timeout_s x retries); "
        "None = wait forever")

    @model_validator(mode="after")
    def _python_cache_needs_seed(self) -> AgentSection:
        if self.cache.enabled and "python" in self.cache.tools and self.python.seed is None:
            raise ValueError("agent.cache.tools includes python but agent.python.seed is unset: each call's random "
                             "generators start from fresh entropy, so a cached result would replay one draw for "
                             "every later call. Set agent.python.seed to an int, or remove python from "
                             "agent.cache.tools")
        return self
