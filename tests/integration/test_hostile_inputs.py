"""Bad input, as a user gives it to `arpo run`: one `error:` line naming the key, the file (and row) and the fix,
exit code 2, no traceback, no retry, no work done. Cases that only show when rows are read go through the real
flow on a Prefect API (the session's test harness); the failed task's state message is the same line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prefect import flow

from stages.core.config.loader import load_config
from stages.core.errors import MissingInputError
from stages.core.rl_parquet import SCHEMA, make_row, write_rl_parquet
from tests.conftest import PROJECT_ROOT

pytestmark = pytest.mark.integration


def arpo(capfd: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    from flows.cli import main

    code = main(["run", *argv])
    return code, capfd.readouterr().err


def one_error_line(err: str) -> str:
    """The single `error:` line of stderr (config errors continue on indented lines), with no traceback."""
    lines = err.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("error:")]
    assert len(starts) == 1, err
    assert "Traceback" not in err and "Retry" not in err, err
    end = next((i for i in range(starts[0] + 1, len(lines)) if not lines[i].startswith("  ")), len(lines))
    return "\n".join(lines[starts[0]:end])


def rows(n: int) -> list[dict]:
    return [make_row(i, "s", "math", "sys", f"what is {i}+1?", str(i + 1), "train") for i in range(n)]


def files(tmp: Path) -> dict[str, Path]:
    """One of each bad file a user can point at."""
    made = {"missing": tmp / "missing.parquet", "csv": tmp / "train_csv.parquet", "nocols": tmp / "nocols.parquet",
            "empty": tmp / "empty.parquet", "corpus": tmp / "corpus.jsonl", "badyaml": tmp / "bad.yaml",
            "eval": tmp / "eval", "model": tmp / "model"}
    made["csv"].write_text("question,answer\nwhat is 1+1?,2\n")
    pq.write_table(pa.table({"question": ["q"], "answer": ["a"]}), made["nocols"])
    write_rl_parquet([], made["empty"])
    made["corpus"].write_text('{"id": "d1", "contents": "Paris is in France"\n')
    made["badyaml"].write_text("rl:\n  rollout: {n: 4\n")
    (made["eval"] / "bamboogle").mkdir(parents=True)
    good = json.dumps({"question": "Who?", "answer": ["Ada"]})
    (made["eval"] / "bamboogle" / "test.jsonl").write_text("\n".join([good, good, good, '{"question": "Who?"', good]))
    made["model"].mkdir()
    return made


PARQUET = ["-o", "data.source=parquet"]
CASES = {
    "unknown key": (["-o", "rl.rollout.beam_sise=3"],
                    "error: invalid config:\n  unknown config key 'rl.rollout.beam_sise': did you mean "
                    "'rl.rollout.beam_size'?"),
    "negative budget": (["-o", "rl.rollout.max_response_length=-1"],
                        "error: invalid config:\n  rl.rollout.max_response_length: Input should be greater than or "
                        "equal to 1 (got -1)"),
    "ignored setting": (["-o", "data.train_path={missing}"],
                        "error: invalid config:\n  data.train_path={missing} is ignored under data.source=synthetic: "
                        "it is used only with data.source=parquet. Set data.source=parquet to use it, or remove "
                        "data.train_path (from the profile or the -o overrides)"),
    "missing parquet": ([*PARQUET, "-o", "data.train_path={missing}"],
                        "error: data.train_path={missing}: {missing} does not exist; fix the path"),
    "csv named parquet": ([*PARQUET, "-o", "data.train_path={csv}"],
                          "error: data.train_path: {csv} is not a readable parquet file (Parquet magic bytes not "
                          "found in footer"),
    "parquet without the columns": ([*PARQUET, "-o", "data.train_path={nocols}"],
                                    "error: data.train_path: {nocols} lacks the column(s) ['prompt', 'reward_model'] "
                                    "(it has ['question', 'answer']); expected the verl RL schema"),
    "empty parquet": ([*PARQUET, "-o", "data.train_path={empty}"],
                      "error: data.train_path: {empty} has no rows; point data.train_path at a file with data"),
    "broken benchmark line": (["-o", "eval.data_root={eval}", "-o", "eval.benchmarks=[bamboogle]"],
                              "error: {eval}/bamboogle/test.jsonl:4: not valid JSON (Expecting ',' delimiter); fix "
                              "or delete that line"),
    "unknown template": (["-o", "agent.prompt_template=tir_nope"],
                         "error: no prompt template 'tir_nope'"),
    "not a model folder": (["-o", "model.source=local", "-o", "model.path={model}"],
                           "error: model.path={model}: {model} is not a Hugging Face model folder (no config.json)"),
    "missing SFT file": (["-o", "sft.dataset=file", "-o", "sft.dataset_path={missing}"],
                         "error: sft.dataset_path={missing}: {missing} does not exist"),
    "malformed profile": (["-p", "{badyaml}"], "error: {badyaml}: not valid YAML"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_error_line_before_any_work(case: str, tmp_path: Path, capfd) -> None:
    made = {name: str(path) for name, path in files(tmp_path).items()}
    argv, expected = CASES[case]
    out = tmp_path / "outputs"
    code, err = arpo(capfd, *[a.format(**made) for a in argv], "-o", f"run.output_root={out}", "--ephemeral")
    assert code == 2 and one_error_line(err).startswith(expected.format(**made)), err
    assert not out.exists()    # no stage started, not even a run record


def test_corpus_with_a_broken_line_names_it(tmp_path: Path, capfd) -> None:
    made = files(tmp_path)
    good = write_rl_parquet(rows(4), tmp_path / "good.parquet")
    code, err = arpo(capfd, *PARQUET, "-o", f"data.train_path={good}", "-o", f"data.corpus_path={made['corpus']}",
                     "-o", f"run.output_root={tmp_path / 'out'}", "--ephemeral")
    assert code == 2 and one_error_line(err) == (
        f"error: data.corpus_path: {made['corpus']}:1: not valid JSON (Expecting ',' delimiter); it must hold one "
        "JSON object per line (fix or delete that line)")


@pytest.fixture
def harness(prefect_harness) -> dict[str, str]:
    """Environment for `arpo run` in a child process that reports to the test harness's API and result store
    (never a developer's server)."""
    from prefect.settings import PREFECT_API_URL

    return {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(PROJECT_ROOT),
            "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(prefect_harness)}


def arpo_process(env: dict[str, str], *argv: str) -> tuple[int, str]:
    """`arpo run ...` as a user runs it; (exit code, everything it printed to stderr)."""
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", *argv], env=env, cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=600)
    return done.returncode, done.stderr


def last_task_run(name: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName
    from prefect.client.schemas.sorting import TaskRunSort

    with get_client(sync_client=True) as client:
        return client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=[name])),
                                     sort=TaskRunSort.EXPECTED_START_TIME_DESC, limit=1)[0]


def null_prompt_parquet(path: Path) -> Path:
    table = rows(4)
    table[2]["prompt"] = None            # a row the footer cannot show: found when the data stage reads rows
    pq.write_table(pa.Table.from_pylist(table, schema=SCHEMA), path)
    return path


def test_a_null_prompt_row_fails_the_data_stage_once_naming_file_and_row(tmp_path: Path, harness) -> None:
    bad = null_prompt_parquet(tmp_path / "train.parquet")
    code, err = arpo_process(harness, "--until", "data", *PARQUET, "-o", f"data.train_path={bad}",
                             "-o", "data.bad_rows=error", "-o", f"run.output_root={tmp_path / 'out'}")
    expected = f"error: {bad} row 2: 'prompt' must be a non-empty list of {{role, content}}, got None"
    assert code == 2 and one_error_line(err) == expected
    task = last_task_run("data")
    assert task.state.is_failed() and task.run_count == 1                       # never retried
    assert task.state.message.endswith(expected.removeprefix("error: "))
    assert not (tmp_path / "out" / "bootstrap").exists()                         # the data stage runs first


def test_bad_rows_are_skipped_by_default_each_named(tmp_path: Path, tiny_model) -> None:
    # as a user without a server runs it: `--ephemeral` (Prefect's temporary server), no event errors either
    bad = null_prompt_parquet(tmp_path / "train.parquet")
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "PREFECT_HOME": str(tmp_path / "prefect")}
    code, err = arpo_process(env, "--until", "data", "--ephemeral", *PARQUET, "-o", f"data.train_path={bad}",
                             "-o", "model.source=local", "-o", f"model.path={tiny_model.path}",
                             "-o", f"run.output_root={tmp_path / 'out'}")
    assert code == 0 and "Traceback" not in err and "ERROR" not in err, err
    assert f"skipping bad row: {bad} row 2: 'prompt' must be a non-empty list" in err
    (train,) = (tmp_path / "out" / "data").glob("*/rl_train.parquet")
    assert pq.read_metadata(train).num_rows == 3


def test_a_train_set_smaller_than_a_batch_fails_before_sft(tmp_path: Path, harness) -> None:
    small = write_rl_parquet(rows(3), tmp_path / "train.parquet")
    out = tmp_path / "out"
    code, err = arpo_process(harness, *PARQUET, "-o", f"data.train_path={small}", "-o", "rl.trainer.train_batch_size=8",
                             "-o", f"run.output_root={out}")
    assert code == 2 and one_error_line(err).startswith(
        f"error: the RL train set ({out.resolve()}/data/") and "has 3 valid rows, fewer than " \
        "rl.trainer.train_batch_size=8 prompts per step" in err
    # no model, no SFT: seconds, not hours (mlflow: the run's tracker store, opened with the run)
    assert sorted(p.name for p in out.iterdir()) == [".locks", "data", "mlflow", "runs"]


def test_a_missing_file_while_the_key_is_computed_fails_the_task_once(tmp_path: Path, prefect_harness) -> None:
    # a deployment run (no CLI pre-flight), or a file deleted after it: the key function meets it first
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterTaskRunId
    from prefect.logging.handlers import APILogWorker

    from stages.core.selection import select_stages
    from tasks.stage_tasks import entry_task, run_stage

    cfg = load_config("tiny-cpu", ["data.source=parquet", f"data.train_path={tmp_path / 'gone.parquet'}"])

    @flow
    def data_only():
        state = run_stage(entry_task("data"), select_stages(), cfg.data, str(tmp_path), return_state=True)
        return state, state.result(raise_on_failure=False)

    state, exc = data_only()
    assert isinstance(exc, MissingInputError) and state.is_failed()
    task_run = last_task_run("data")
    assert task_run.run_count == 1 and f"data.train_path={tmp_path / 'gone.parquet'}" in task_run.state.message
    APILogWorker.drain_all()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run.id])))
    text = "\n".join(log.message for log in logs)
    assert f"data.train_path={tmp_path / 'gone.parquet'}" in text
    assert "Traceback" not in text and "computing cache key" not in text
