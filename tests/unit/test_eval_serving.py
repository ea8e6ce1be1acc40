"""Serving pieces without a model: the vLLM command line, process-group teardown, the supervisor, backends'
error messages, and the batched engine's per-row sampling maths."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from stages.core.config.eval import JudgeSection
from stages.core.config.serve import ServeSection, VLLMSection
from stages.core.refs import EndpointRef, ModelRef
from stages.eval.cpu_engine import SamplingParams, first_stop, pick_tokens
from stages.eval.procs import free_port, group_members, kill_group, launch
from stages.eval.serving import cpu_server_command, start_judge, start_server, stop_server
from stages.eval.vllm_cmd import ServeError, resolve_executable, vllm_command

torch.set_num_threads(1)
MODEL = ModelRef(path="/models/qwen7b", fingerprint="f" * 16, name="Qwen2.5-7B-Instruct")


def test_vllm_command_line_carries_every_setting() -> None:
    cfg = ServeSection(backend="vllm", host="0.0.0.0", vllm=VLLMSection(
        executable="/envs/vllm/bin/vllm", tensor_parallel_size=2, gpu_memory_utilization=0.75, max_model_len=32768,
        extra_args=["--enforce-eager"]))
    assert vllm_command(cfg, "/models/qwen7b", "Qwen2.5-7B-Instruct", 8002) == [
        "/envs/vllm/bin/vllm", "serve", "/models/qwen7b", "--host", "0.0.0.0", "--port", "8002",
        "--served-model-name", "Qwen2.5-7B-Instruct", "--tensor-parallel-size", "2",
        "--gpu-memory-utilization", "0.75", "--max-model-len", "32768", "--enforce-eager"]


def test_vllm_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        VLLMSection(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        VLLMSection(gpu_memory_utilization=1.5)


def test_missing_vllm_executable_says_how_to_install_it(tmp_path: Path) -> None:
    with pytest.raises(ServeError, match=r"own environment.*serve\.vllm\.executable"):
        resolve_executable(str(tmp_path / "no-vllm"))
    exe = tmp_path / "vllm"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert resolve_executable(str(exe)) == str(exe)


def test_cpu_server_command(tmp_path: Path) -> None:
    cfg = ServeSection(max_batch_size=4, batch_wait_ms=5, threads=1)
    model = MODEL.model_copy(update={"meta": {"dtype": "bfloat16"}})
    cmd = cpu_server_command(cfg, model, "smol", tmp_path / "port")
    assert cmd[:3] == [sys.executable, "-m", "stages.eval.cpu_server"]
    args = dict(zip(cmd[3::2], cmd[4::2]))
    assert args == {"--model": "/models/qwen7b", "--served-name": "smol", "--host": "127.0.0.1", "--port": "0",
                    "--port-file": str(tmp_path / "port"), "--max-batch-size": "4", "--batch-wait-ms": "5.0",
                    "--prefix-cache-entries": "8", "--dtype": "bfloat16", "--threads": "1"}


def _forking_command() -> list[str]:
    # a parent that forks a grandchild; both sleep: killing must reach the whole group
    code = "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"
    return [sys.executable, "-c", code]


def test_kill_group_ends_the_server_and_its_children(tmp_path: Path) -> None:
    proc = launch(_forking_command(), tmp_path / "x.log")
    deadline = time.monotonic() + 20
    while len(group_members(proc.pid)) < 3 and time.monotonic() < deadline:  # supervisor, python, sleep
        time.sleep(0.05)
    assert len(group_members(proc.pid)) == 3
    kill_group(proc.pid, grace_s=5, proc=proc)
    assert group_members(proc.pid) == []
    assert proc.returncode is not None                      # reaped, not a zombie
    assert (tmp_path / "x.log").read_text().startswith("$ ")  # the command line heads the captured log


def test_supervisor_kills_the_group_when_the_pipeline_dies_by_sigkill(tmp_path: Path) -> None:
    pgid_file = tmp_path / "pgid"
    script = textwrap.dedent(f"""
        import sys, time
        from stages.eval.procs import launch
        proc = launch({_forking_command()!r}, {str(tmp_path / 'x.log')!r})
        open({str(pgid_file)!r}, 'w').write(str(proc.pid))
        time.sleep(300)
    """)
    pipeline = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + 30
        while (not pgid_file.is_file() or len(group_members(int(pgid_file.read_text() or 0))) < 3) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        pgid = int(pgid_file.read_text())
        assert len(group_members(pgid)) == 3
        os.kill(pipeline.pid, signal.SIGKILL)                 # no finally, no atexit runs
        pipeline.wait()
        deadline = time.monotonic() + 20
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert group_members(pgid) == []
    finally:
        if pipeline.poll() is None:
            pipeline.kill()
            pipeline.wait()


def test_external_backend_errors_name_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(ServeError, match="needs serve.url"):
        start_server(ServeSection(backend="external"), MODEL, tmp_path)
    monkeypatch.delenv("ARPO_TEST_KEY", raising=False)
    cfg = ServeSection(backend="external", url="http://127.0.0.1:1/v1", api_key_env="ARPO_TEST_KEY")
    with pytest.raises(ServeError, match="export ARPO_TEST_KEY"):
        start_server(cfg, MODEL, tmp_path)
    port = free_port()  # nothing listens there
    with pytest.raises(ServeError, match="does not answer"):
        start_server(ServeSection(backend="external", url=f"http://127.0.0.1:{port}/v1"), MODEL, tmp_path)


def test_unknown_backend_lists_the_known_ones() -> None:
    from stages.eval.serving import BACKENDS

    assert BACKENDS.names() == ["cpu", "external", "vllm"]


def test_judge_is_none_policy_or_served(tmp_path: Path) -> None:
    policy = EndpointRef(url="http://127.0.0.1:9/v1", model="smol", meta={"pgid": 999999999, "backend": "cpu"})
    assert start_judge(JudgeSection(enabled=False), policy, tmp_path) is None
    judge = start_judge(JudgeSection(model="policy"), policy, tmp_path)
    assert judge.url == policy.url and judge.model == "smol" and judge.meta["shared_with"] == "policy"
    stop_server(judge)  # shared: a no-op, never kills the policy server (pgid 999999999 would raise otherwise)
    with pytest.raises(ServeError, match="needs the policy endpoint"):
        start_judge(JudgeSection(model="policy"), None, tmp_path)
    with pytest.raises(ServeError, match="eval.judge.path"):
        start_judge(JudgeSection(model="path"), policy, tmp_path)


# ---------------------------------------------------------------------------------- per-row sampling maths
def test_first_stop_is_the_earliest_starting_one() -> None:
    # "a</python>b</search>": </python> starts at 1, </search> at 11
    assert first_stop("a</python>b</search>", ("</search>", "</python>")) == (1, "</python>")
    assert first_stop("abc", ("</search>",)) is None
    # two stops starting at the same index: the longer one wins
    assert first_stop("x</answer>", ("</a", "</answer>")) == (1, "</answer>")


def pick_token(scores_V, context_T, params, generator) -> int:
    return pick_tokens(scores_V.unsqueeze(0), [context_T], [params], [generator])[0]


def test_pick_token_greedy_top_k_top_p_and_repetition_penalty() -> None:
    scores_V = torch.tensor([2.0, 1.9, -1.0, 0.0])
    context_T = torch.tensor([0, 3])
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    assert pick_token(scores_V, context_T, greedy, None) == 0
    # repetition penalty 1.1 divides positive logits of seen tokens: 2.0/1.1 = 1.818 < 1.9 -> token 1
    assert pick_token(scores_V, context_T, SamplingParams(max_tokens=1, temperature=0.0, repetition_penalty=1.1),
                      None) == 1
    gen = torch.Generator().manual_seed(0)
    # top_k=1 keeps only the argmax, so sampling at any temperature returns it
    assert all(pick_token(scores_V, context_T, SamplingParams(max_tokens=1, temperature=5.0, top_k=1), gen) == 0
               for _ in range(20))
    # softmax([2, 1.9, -1, 0]) = [0.497, 0.450, 0.025, 0.067]: top_p=0.4 keeps only token 0
    assert all(pick_token(scores_V, context_T, SamplingParams(max_tokens=1, top_p=0.4), gen) == 0 for _ in range(20))
    # min_p=0.5 keeps tokens with p >= 0.5 * 0.497: tokens 0 and 1 only
    picks = {pick_token(scores_V, context_T, SamplingParams(max_tokens=1, min_p=0.5), gen) for _ in range(200)}
    assert picks == {0, 1}


def test_same_seed_same_token_sequence() -> None:
    scores_V = torch.zeros(50)  # uniform over 50 tokens
    params = SamplingParams(max_tokens=1)
    gen_a, gen_b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    seq_a = [pick_token(scores_V, torch.tensor([1]), params, gen_a) for _ in range(10)]
    seq_b = [pick_token(scores_V, torch.tensor([1]), params, gen_b) for _ in range(10)]
    assert seq_a == seq_b and len(set(seq_a)) > 1


def test_batched_rows_pick_what_each_row_picks_alone() -> None:
    torch.manual_seed(0)
    scores_BV = torch.randn(4, 30)
    contexts = [torch.tensor([1, 2]), torch.tensor([3]), torch.tensor([4, 5, 6]), torch.tensor([7])]
    params = [SamplingParams(max_tokens=1, temperature=0.0),
              SamplingParams(max_tokens=1, temperature=0.8, top_p=0.9, seed=5),
              SamplingParams(max_tokens=1, temperature=0.8, top_p=0.9, repetition_penalty=1.3, seed=6),
              SamplingParams(max_tokens=1, temperature=1.2, top_k=5, seed=7)]
    seeds = [None, 5, 6, 7]

    def gens():
        return [torch.Generator().manual_seed(s) if s is not None else None for s in seeds]

    together = pick_tokens(scores_BV, contexts, params, gens())
    alone = [pick_tokens(scores_BV[i:i + 1], [contexts[i]], [params[i]], [g])[0] for i, g in enumerate(gens())]
    assert together == alone
    assert together[0] == int(scores_BV[0].argmax())       # the greedy row takes its argmax


@pytest.mark.parametrize("bad, message", [({"max_tokens": 0}, "max_tokens"), ({"top_p": 0.0}, "top_p"),
                                          ({"logprobs": 21}, "logprobs"), ({"stop": ("",)}, "stop strings")])
def test_sampling_params_reject_bad_values(bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**({"max_tokens": 4} | bad))
