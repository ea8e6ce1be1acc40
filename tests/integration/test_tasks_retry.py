"""Stage tasks retry transient failures only: a config or data error (InputError) fails once, with its message,
under a real Prefect API (prefect_test_harness)."""

from __future__ import annotations

import pytest
from prefect import flow

from stages.core.errors import MissingInputError
from tasks.stage_tasks import stage_task

pytestmark = pytest.mark.integration
ATTEMPTS: list[str] = []


@stage_task("retry-probe", retries=2, retry_delay_seconds=0, off_table=True)
def probe(kind: str, force: bool = False) -> str:
    ATTEMPTS.append(kind)
    if kind == "missing":
        raise MissingInputError("benchmark 'gaia': no file at any of [/x/gaia/test.jsonl]")
    if kind == "bad-config":
        from stages.core.config.loader import load_config

        load_config("tiny-cpu", ["rl.algorithm=grpo", "rl.loss.policy_loss=aepo_balanced_clip"])
    raise ConnectionError("the server went away")  # transient: worth retrying


def outcome(state) -> tuple[bool, str, BaseException]:
    """(failed, task run id, the exception): read inside the flow, so the flow itself does not fail on it."""
    return state.is_failed(), str(state.state_details.task_run_id), state.result(raise_on_failure=False)


def run_count(task_run_id: str) -> int:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_task_run(task_run_id).run_count


@pytest.mark.parametrize("kind,attempts,error", [
    ("missing", 1, "benchmark 'gaia': no file at any of"),
    ("bad-config", 1, "rl.loss.policy_loss=aepo_balanced_clip: AEPO setting"),
    ("transient", 3, "the server went away"),    # 1 + retries=2
])
def test_input_errors_are_not_retried(prefect_harness, kind, attempts, error) -> None:
    ATTEMPTS.clear()

    @flow
    def one():
        return outcome(probe(kind, return_state=True))

    failed, run_id, exc = one()
    assert failed and ATTEMPTS == [kind] * attempts and run_count(run_id) == attempts
    assert error in str(exc)


def test_missing_benchmark_fails_the_real_infer_task_once(prefect_harness, tmp_path, monkeypatch) -> None:
    from stages.core.config.loader import load_config
    from stages.core.refs import DatasetRef, EndpointRef, ModelRef
    from tasks.eval_infer import infer_task

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cfg = load_config("tiny-cpu", [f"eval.data_root={tmp_path}"])
    model = ModelRef(path=str(tmp_path / "model"), fingerprint="m")
    endpoint = EndpointRef(url="http://127.0.0.1:9/v1", model="m")
    data = DatasetRef(path=str(tmp_path), fingerprint="d", files={})

    @flow
    def infer():
        return outcome(infer_task(cfg.eval, cfg.agent, "bamboogle", model, endpoint, data, str(tmp_path / "out"),
                                  str(tmp_path / "cache"), return_state=True))

    failed, run_id, exc = infer()
    assert failed and run_count(run_id) == 1    # the task has retries=1: it was not used
    assert isinstance(exc, MissingInputError) and "benchmark 'bamboogle': no file at any of [" in str(exc)


def test_cli_reports_a_missing_benchmark_before_any_work(tmp_path, monkeypatch, capsys) -> None:
    # `arpo run` checks the benchmark files right after the config, before bootstrap/SFT/RL start: exit code 2
    # and the message, no traceback
    from flows.cli import main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    code = main(["run", "-o", f"eval.data_root={tmp_path}", "-o", "eval.benchmarks=[synthetic, gaia, hle]"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: benchmark 'gaia': no file at any of [")
    assert "hle/top.json" in err and "Traceback" not in err
