"""The deep-search summariser the evaluation serves (agent.search.summarizer.path), like the judge: how the config
resolves it, the server it starts, when a rerun starts none, and the inference key, which never sees where it runs.
With a live vLLM server: tests/integration/test_eval_summarizer.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from stages.core.config.agent import AgentSection, SearchSection
from stages.core.config.browse import SummarizerSection
from stages.core.config.eval import EvalSection
from stages.core.config.loader import ConfigError, load_config
from stages.core.config.serve import ServeSection, VLLMSection
from stages.core.errors import BadInputError
from stages.core.refs import DatasetRef, EndpointRef, ModelRef
from stages.eval import reuse, serving
from stages.eval.inference import benchmark_agent, inference_key
from stages.eval.search_mode import check_summarizer, keyed_agent, serves_summarizer, summarizer_search
from stages.eval.vllm_cmd import ServeError

MODEL = ModelRef(path="/m", fingerprint="a" * 16, name="smol")
DATA = DatasetRef(path="/d", fingerprint="d" * 16, files={})
POLICY = EndpointRef(url="http://127.0.0.1:4000/v1", model="smol")
SERVED = ["agent.search.summarizer.path=/models/summ", "eval.benchmarks=[synthetic, gaia]", "eval.browse=[gaia]",
          "eval.judge.enabled=false"]


def test_a_path_turns_the_summariser_on_under_its_last_name() -> None:
    hub = SummarizerSection(path="Qwen/Qwen3-14B")
    assert (hub.model, hub.url, hub.served_here) == ("Qwen3-14B", None, True)   # the hub id's last part
    assert SummarizerSection(path="/models/summ/").model == "summ"                # a folder, trailing slash
    assert SummarizerSection(path="/models/summ", model="S").model == "S"         # an explicit name is kept
    external = SummarizerSection(model="Qwen3-14B", url="http://h:8004/v1")
    assert not external.served_here and not SummarizerSection().served_here    # url: a server the user runs


@pytest.mark.parametrize("given, message", [
    ({"model": "m", "url": "http://h/v1", "path": "/p"}, "both url='http://h/v1'.*and path='/p'.*url=null"),
    ({"model": "m"}, r"model='m' needs a place to run: agent\.search\.summarizer\.url .* agent\.search\.summarizer"
                     r"\.path"),
    ({"model": "m", "url": "http://h/v1", "serve": {"port": 5}}, "serve is set but agent.search.summarizer.path is "
                                                                 "not"),
    ({"path": "/p", "serve": {"served_name": "other"}}, "served_name='other' differs from agent.search.summarizer."
                                                        "model='p'"),
])
def test_summariser_config_errors_name_the_key_and_the_fix(given: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SummarizerSection(**given)


def test_run_config_rules_for_a_served_summariser() -> None:
    cfg = load_config("tiny-cpu", SERVED)
    assert cfg.agent.search.summarizer.served_here and cfg.agent.search.summarizer.model == "summ"
    # training stages cannot reach a summariser the evaluation serves: browse.enabled with a path is refused
    with pytest.raises(ConfigError, match=r"browse\.enabled browses in every stage.*summarizer\.url.*eval\.browse"):
        load_config("tiny-cpu", [*SERVED, "agent.search.browse.enabled=true"])
    # the paper profile switched from its url to a served model, as its comment says
    paper = load_config("arpo-qwen3-14b-deepsearch", ["agent.search.summarizer.url=null",
                                                      "agent.search.summarizer.path=Qwen/Qwen3-14B"])
    summ = paper.agent.search.summarizer
    assert (summ.model, summ.path, summ.serve.backend) == ("Qwen3-14B", "Qwen/Qwen3-14B", "vllm")


def test_start_summarizer_serves_the_path_like_the_judge(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    started = []

    def fake_start(cfg: ServeSection, model: ModelRef, log_dir: Path) -> EndpointRef:
        started.append((cfg, model, log_dir))
        return EndpointRef(url="http://127.0.0.1:7/v1", model=cfg.served_name, meta={"pgid": 1})

    monkeypatch.setattr(serving, "start_server", fake_start)
    assert serving.start_summarizer(SummarizerSection(), tmp_path) is None                      # no summariser
    assert serving.start_summarizer(SummarizerSection(model="m", url="http://h/v1"), tmp_path) is None  # user's
    assert started == []
    folder = tmp_path / "summ"
    folder.mkdir()
    (folder / "config.json").write_text('{"a": 1}')
    serve = ServeSection(vllm=VLLMSection(max_model_len=4096, tensor_parallel_size=2))
    endpoint = serving.start_summarizer(SummarizerSection(path=str(folder), serve=serve), tmp_path)
    cfg, model, log_dir = started[0]
    assert endpoint.model == "summ" and log_dir == tmp_path
    assert cfg.served_name == "summ" and cfg.vllm == serve.vllm                  # summarizer.serve, its served name
    assert (model.path, model.name) == (str(folder), "summ")
    first = model.fingerprint
    (folder / "config.json").write_text('{"a": 2}')                             # another model in the same folder
    serving.start_summarizer(SummarizerSection(path=str(folder), serve=serve), tmp_path)
    assert started[1][1].fingerprint != first
    with pytest.raises(ServeError, match="only from agent.search.summarizer.path"):
        serving.summarizer_model_ref(SummarizerSection(model="m", url="http://h/v1"))


@pytest.mark.parametrize("done, refresh, expected", [
    ({"synthetic": True, "gaia": True}, [], (False, False)),      # every prediction cached: nothing starts
    ({"synthetic": False, "gaia": True}, [], (True, False)),      # only the snippet benchmark: no summariser
    ({"synthetic": True, "gaia": False}, [], (True, True)),       # the browsing one: policy + summariser
    ({"synthetic": True, "gaia": True}, ["infer"], (True, True)),  # refreshed inference
])
def test_summariser_starts_only_for_missing_browsing_predictions(monkeypatch: pytest.MonkeyPatch, done: dict,
                                                                 refresh: list, expected: tuple) -> None:
    monkeypatch.setattr(reuse, "finished_inference",
                        lambda cfg, agent, name, model, endpoint, data, root: "fp" if done[name] else None)
    monkeypatch.setattr(reuse, "inference_marker", lambda *args: None)
    needs = reuse.serving_needs(load_config("tiny-cpu", SERVED), MODEL, DATA, refresh, score=True)
    assert (needs.policy, needs.summarizer) == expected and not needs.judge
    # a summariser at a url is never started, whatever is missing
    user = load_config("tiny-cpu", [*SERVED[1:], "agent.search.summarizer.model=m",
                                    "agent.search.summarizer.url=http://h/v1"])
    assert not reuse.serving_needs(user, MODEL, DATA, refresh, score=True).summarizer


def test_where_the_summariser_runs_is_not_in_the_inference_key() -> None:
    cfg = EvalSection(browse=["gaia"])
    served = AgentSection(search=SearchSection(backend="web", summarizer={"path": "/models/summ"}))
    moved = AgentSection(search=SearchSection(backend="web", summarizer={
        "path": "/models/summ", "serve": {"port": 8123, "startup_timeout_s": 60}, "timeout_s": 9}))
    other = AgentSection(search=SearchSection(backend="web", summarizer={"path": "/models/other", "model": "summ"}))
    key = lambda agent: inference_key(cfg, agent, "gaia", "h", MODEL, POLICY, DATA)  # noqa: E731
    assert key(served) == key(moved)                  # port, start-up wait, timeout: the same predictions
    assert key(served) != key(other)                  # other weights under the same served name: recomputed
    assert keyed_agent(moved).search.summarizer.serve == ServeSection()
    # a user's server at another address gives the same summaries too
    at = lambda url: AgentSection(search=SearchSection(backend="web", summarizer={"model": "m", "url": url}))  # noqa
    assert key(at("http://a:1/v1")) == key(at("http://b:2/v1"))


def test_the_toolbox_reaches_the_served_summariser_at_its_endpoint() -> None:
    cfg = EvalSection(browse=["gaia"])
    agent = AgentSection(search=SearchSection(backend="web", summarizer={"path": "/models/summ"}))
    assert serves_summarizer(cfg, agent.search, "gaia") and not serves_summarizer(cfg, agent.search, "hotpotqa")
    search = benchmark_agent(cfg, agent, "gaia").search
    endpoint = EndpointRef(url="http://127.0.0.1:7001/v1", model="summ", api_key_env=None)
    reached = summarizer_search(search, endpoint).summarizer
    assert (reached.url, reached.model, reached.path) == ("http://127.0.0.1:7001/v1", "summ", "/models/summ")
    assert summarizer_search(agent.search, None) is agent.search       # a benchmark that does not browse
    with pytest.raises(BadInputError, match=r"summarizer\.path='/models/summ' is served by the evaluation.*"
                                            r"start_summarizer"):
        summarizer_search(search, None)

    def down(url: str, **_: object) -> None:
        raise ConnectionError("refused")

    # the server this evaluation started does not answer: not a config error, its log says why
    with pytest.raises(ServeError, match=r"served from agent\.search\.summarizer\.path='/models/summ' does not "
                                         r"answer http://127\.0\.0\.1:7001/v1/models"):
        check_summarizer(summarizer_search(search, endpoint), get=down)


@pytest.mark.parametrize("fail", [False, True])
def test_the_pipeline_stops_policy_and_summariser_servers_even_when_evaluation_fails(
        monkeypatch: pytest.MonkeyPatch, fail: bool) -> None:
    import flows.pipeline as pipeline
    from stages.core.selection import select_stages

    cfg = load_config("tiny-cpu", SERVED)
    policy = EndpointRef(url="http://127.0.0.1:1/v1", model="smol", meta={"pgid": 1})
    summ = EndpointRef(url="http://127.0.0.1:2/v1", model="summ", meta={"pgid": 2})
    needs = reuse.ServingNeeds(policy=True, judge=False, policy_endpoint=policy, judge_endpoint=None,
                               missing=["infer:gaia"], summarizer=True)
    seen: dict[str, object] = {"stopped": []}

    def fanout(cfg, model, data, endpoint, judge, refresh, score, retry, summarizer):
        seen["fanout"] = (endpoint, summarizer)
        if fail:
            raise RuntimeError("inference failed")
        return {"score": []}

    monkeypatch.setattr(pipeline, "serving_needs_task", lambda *args: needs)
    monkeypatch.setattr(pipeline, "serve_task", lambda *args: policy)
    monkeypatch.setattr(pipeline, "judge_serve_task", lambda *args: pytest.fail("no judge is needed"))
    monkeypatch.setattr(pipeline, "summarizer_serve_task",
                        lambda section, run_dir, devices: summ if section == cfg.agent.search.summarizer else None)
    monkeypatch.setattr(pipeline, "FANOUT", {"threads": lambda cfg: fanout})
    monkeypatch.setattr(pipeline, "run_stage", lambda *args, **kw: "report")
    monkeypatch.setattr(pipeline, "stop_task", lambda endpoint: seen["stopped"].append(endpoint))
    selection = select_stages()
    if fail:
        with pytest.raises(RuntimeError, match="inference failed"):
            pipeline.evaluate(cfg, selection, MODEL, DATA, "/run", {})
    else:
        pipeline.evaluate(cfg, selection, MODEL, DATA, "/run", {})
    assert seen["fanout"] == (policy, summ)                   # the inference tasks get the summariser's endpoint
    assert seen["stopped"] == [policy, summ]                  # both servers stop, in a finally
    # nothing to summarise (its benchmarks cached): no summariser server, nothing else to stop
    monkeypatch.setattr(pipeline, "serving_needs_task", lambda *args: needs.model_copy(update={"summarizer": False}))
    monkeypatch.setattr(pipeline, "summarizer_serve_task", lambda *args: pytest.fail("not needed"))
    seen["stopped"] = []
    if not fail:
        pipeline.evaluate(cfg, selection, MODEL, DATA, "/run", {})
        assert seen["fanout"] == (policy, None) and seen["stopped"] == [policy]
