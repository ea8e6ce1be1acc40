"""Bad input is refused when the config or the data loads, with the key, the file (and row) and the fix: settings the
chosen mode ignores (one rule in the config layer), sizes that cannot work, missing / unreadable / malformed input
files (stages.core.input_files), and a train set smaller than one batch."""

from __future__ import annotations

import os
import typing
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import BaseModel

from stages.core.config.loader import CONFIG_DIR, ConfigError, load_config
from stages.core.config.root import RunConfig
from stages.core.errors import BadInputError, MissingInputError
from stages.core.input_check import check_inputs
from stages.core.input_files import check_input, check_rl_rows, hash_input, input_file
from stages.core.refs import DatasetRef
from stages.core.rl_parquet import make_row, write_rl_parquet

ALL_STAGES = ["bootstrap", "data", "sft", "rl", "heldout", "infer"]


@pytest.mark.parametrize("overrides,message", [
    (["data.train_path=/d/train.parquet"],
     "data.train_path=/d/train.parquet is ignored under data.source=synthetic: it is used only with "
     "data.source=parquet. Set data.source=parquet to use it, or remove data.train_path"),
    (["model.path=/models/qwen"], "model.path=/models/qwen is ignored under model.source=pypi_gguf: it is used only "
                                  "with model.source=hub|local|toy. Set model.source=hub to use it"),
    (["sft.lora_rank=16"], "sft.lora_rank=16 is ignored under sft.finetuning_type=full"),
    (["sft.dataset_path=/d/sft.jsonl"], "sft.dataset_path=/d/sft.jsonl is ignored under sft.dataset=teacher"),
    (["agent.search.replay_path=/d/cache.json"], "agent.search.replay_path=/d/cache.json is ignored under "
                                                 "agent.search.backend=local"),
    (["eval.judge.path=/j"], "eval.judge.path=/j is ignored under eval.judge.model=policy"),
    (["rl.rollout.kv_reuse=false", "rl.rollout.backend=vllm"],
     "rl.rollout.kv_reuse=false is ignored under rl.rollout.backend=vllm"),
    (["serve.url=http://h/v1"], "serve.url=http://h/v1 is ignored under serve.backend=vllm"),
])
def test_a_setting_the_mode_ignores_is_refused_with_the_fix(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config("tiny-cpu", overrides)
    assert message in str(err.value)


def test_the_same_settings_in_their_mode_are_accepted(tmp_path: Path) -> None:
    cfg = load_config("tiny-cpu", ["data.source=parquet", "data.train_path=/d/train.parquet", "model.source=local",
                                   "model.path=/m", "sft.finetuning_type=lora", "sft.lora_rank=16"])
    # a profile's tuned values for the other mode (tiny-cpu's data.synthetic.*) are not "set by the user": kept
    assert cfg.data.train_path == "/d/train.parquet" and cfg.sft.lora_rank == 16 and cfg.data.synthetic.n_math == 60


def _sections(model: type[BaseModel]) -> typing.Iterator[type[BaseModel]]:
    yield model
    for field in model.model_fields.values():
        for arg in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                yield from _sections(arg)


def test_every_mode_declaration_names_a_sibling_and_its_values() -> None:
    # the rule is only as good as its declarations: a typo in a mode name or value would silently never fire
    checked = 0
    for section in set(_sections(RunConfig)):
        for name, field in section.model_fields.items():
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            for mode, allowed in (extra.get("used_when") or {}).items():
                if mode not in section.model_fields:   # only TrainingSection.lora_* (DPO has no finetuning_type)
                    assert section.__name__ == "DPOSection" and name.startswith("lora_"), (section, name, mode)
                    continue
                annotation = section.model_fields[mode].annotation
                choices = typing.get_args(annotation) or ((True, False) if annotation is bool else None)
                assert choices is not None or annotation is str, (section.__name__, name, mode)
                assert choices is None or set(allowed) <= set(choices), (section.__name__, name, mode, allowed)
                checked += 1   # a str mode (rl.rollout.entropy_quantity, a registry name) is not enumerable
    assert checked >= 30


@pytest.mark.parametrize("override,message", [
    ("rl.rollout.max_response_length=-1", "rl.rollout.max_response_length: Input should be greater than or equal to 1"),
    ("rl.rollout.max_prompt_length=0", "rl.rollout.max_prompt_length: Input should be greater than or equal to 1"),
    ("eval.max_tokens=0", "eval.max_tokens: Input should be greater than or equal to 1"),
    ("rl.optim.lr=-1e-6", "rl.optim.lr: Input should be greater than or equal to 0"),  # 0: a control run
    ("rl.loss.clip_ratio_c=1", "rl.loss.clip_ratio_c: Input should be greater than 1"),
    ("eval.pass_k=[1,4]", "eval.pass_k=[1, 4] has k=4 but pass@k needs 1 <= k <= eval.samples=2"),
    ("agent.search.backend=server", "agent.search.backend=server needs agent.search.server_url"),
])
def test_sizes_and_settings_that_cannot_work_fail_when_the_config_loads(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config("tiny-cpu", [override])
    assert message in str(err.value)


def test_a_bad_profile_file_names_the_file(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("rl:\n  rollout: [n: 4\n")
    with pytest.raises(ConfigError, match=f"{broken}: not valid YAML"):
        load_config(str(broken))
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    with pytest.raises(ConfigError, match="no profile"):
        load_config(str(folder))
    listed = tmp_path / "listed.yaml"
    listed.write_text("- rl\n- sft\n")
    with pytest.raises(ConfigError, match=f"{listed}: top level must be a mapping"):
        load_config(str(listed))
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ConfigError, match=f"cannot read config file {binary}"):
        load_config(str(binary))
    assert (CONFIG_DIR / "profiles" / "tiny-cpu.yaml").is_file()


def _parquet(path: Path, rows: int = 3) -> Path:
    return write_rl_parquet([make_row(i, "s", "math", "sys", f"q{i}", "1", "train") for i in range(rows)], path)


def _parquet_cfg(path: Path, **more: str) -> RunConfig:
    return load_config("tiny-cpu", ["data.source=parquet", f"data.train_path={path}",
                                    *[f"{k}={v}" for k, v in more.items()]])


def test_good_inputs_pass(tmp_path: Path) -> None:
    check_inputs(_parquet_cfg(_parquet(tmp_path / "t.parquet")), ALL_STAGES)
    check_inputs(load_config("tiny-cpu"), ALL_STAGES)   # templates only


def test_missing_parquet_names_key_path_and_where_relative_paths_start(tmp_path: Path) -> None:
    with pytest.raises(MissingInputError) as err:
        check_inputs(_parquet_cfg(tmp_path / "nope.parquet"), ["data"])
    assert str(err.value).startswith(f"data.train_path={tmp_path / 'nope.parquet'}: ")
    assert f"does not exist; fix the path (relative paths are taken from {os.getcwd()})" in str(err.value)
    check_inputs(_parquet_cfg(tmp_path / "nope.parquet"), ["bootstrap"])   # a stage that does not read it: fine


def test_a_csv_named_parquet_is_not_parquet(tmp_path: Path) -> None:
    fake = tmp_path / "train.parquet"
    fake.write_text("prompt,answer\nwhat,1\n")
    with pytest.raises(BadInputError, match=r"data.train_path: .*train.parquet is not a readable parquet file "
                                            r"\(Parquet magic bytes not found"):
        check_inputs(_parquet_cfg(fake), ["data"])


def test_parquet_without_the_rl_columns_or_rows(tmp_path: Path) -> None:
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"question": ["q"], "answer": ["a"]}), other)
    with pytest.raises(BadInputError, match=r"lacks the column\(s\) \['prompt', 'reward_model'\] \(it has "
                                            r"\['question', 'answer'\]\); expected the verl RL schema"):
        check_inputs(_parquet_cfg(other), ["data"])
    with pytest.raises(BadInputError, match="empty.parquet has no rows; point data.train_path at a file with data"):
        check_inputs(_parquet_cfg(_parquet(tmp_path / "empty.parquet", rows=0)), ["data"])


def test_jsonl_corpus_with_a_broken_first_line_and_a_folder_for_a_file(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('\n{"id": 1, "contents": "x"\n')
    cfg = _parquet_cfg(_parquet(tmp_path / "t.parquet"), **{"data.corpus_path": str(corpus)})
    with pytest.raises(BadInputError, match=rf"data.corpus_path: {corpus}:2: not valid JSON \(Expecting ',' "
                                            r"delimiter\); it must hold one JSON object per line"):
        check_inputs(cfg, ["data"])
    with pytest.raises(BadInputError, match=f"data.corpus_path={tmp_path}: {tmp_path} is a folder, not a file"):
        check_inputs(_parquet_cfg(_parquet(tmp_path / "t.parquet"), **{"data.corpus_path": str(tmp_path)}), ["data"])


def test_an_unreadable_file_says_so(tmp_path: Path) -> None:
    path = _parquet(tmp_path / "t.parquet")
    path.chmod(0)
    if os.geteuid() != 0:
        with pytest.raises(BadInputError, match="cannot read .* fix its permissions"):
            check_inputs(_parquet_cfg(path), ["data"])
        return
    # root reads files whatever their mode: check as `nobody`, in a forked child, on a file in a folder it can enter
    tmp_path.chmod(0o755)
    for parent in tmp_path.parents:
        if parent.stat().st_uid == 0 and parent != Path("/"):
            parent.chmod(parent.stat().st_mode | 0o011)   # traversable (pytest's basetemp is 0700)
    cfg = _parquet_cfg(path)
    pid = os.fork()
    if pid == 0:                                            # the child: no pytest machinery, an exit code only
        code = 3
        try:
            os.setgid(65534)
            os.setuid(65534)
            check_inputs(cfg, ["data"])
            code = 2                                        # read it: the check did not notice
        except BadInputError as err:
            code = 0 if "cannot read" in str(err) and "fix its permissions" in str(err) else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "as nobody: want 'cannot read ... fix its permissions' (1: " \
        "another message, 2: no error, 3: something else failed)"


def test_model_folder_templates_sft_files_and_executables(tmp_path: Path) -> None:
    cfg = load_config("tiny-cpu", ["model.source=local", f"model.path={tmp_path}"])
    with pytest.raises(MissingInputError, match=f"model.path={tmp_path}: {tmp_path} is not a Hugging Face model "
                                                "folder \\(no config.json\\)"):
        check_inputs(cfg, ["bootstrap"])
    with pytest.raises(MissingInputError, match="no prompt template 'tir_nope'"):
        check_inputs(load_config("tiny-cpu", ["data.system_prompt=tir_nope"]), ["data"])
    sft = tmp_path / "sft.csv"
    sft.write_text("a,b\n")
    with pytest.raises(BadInputError, match="sft.dataset_path: .*sft.csv has the extension '.csv'; use a .json, "
                                            ".jsonl or .parquet file"):
        check_inputs(load_config("tiny-cpu", ["sft.dataset=file", f"sft.dataset_path={sft}"]), ["sft"])
    listed = tmp_path / "sft.json"
    listed.write_text('{"conversations": []}')
    with pytest.raises(BadInputError, match="must hold a JSON list of rows; it starts with '{\"conversations"):
        check_input("sft.dataset_path", str(listed), input_file("records")["input"])
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(BadInputError, match="agent.python.python_executable: .* is not executable"):
        check_inputs(load_config("tiny-cpu", [f"agent.python.python_executable={script}"]), ["sft"])


def test_a_key_fingerprint_of_a_missing_file_is_an_input_error(tmp_path: Path) -> None:
    # what a stage key takes of an input file: never a bare FileNotFoundError while Prefect computes a cache key
    with pytest.raises(MissingInputError, match=f"sft.dataset_path={tmp_path / 'x.jsonl'}: .* does not exist"):
        hash_input(str(tmp_path / "x.jsonl"), "sft.dataset_path")
    from stages.data.prepare import data_key

    with pytest.raises(MissingInputError, match="data.train_path=.*gone.parquet"):
        data_key(_parquet_cfg(tmp_path / "gone.parquet").data)


def test_a_train_set_smaller_than_one_batch(tmp_path: Path) -> None:
    rl = load_config("tiny-cpu", ["rl.trainer.train_batch_size=4"]).rl
    data = DatasetRef(path=str(tmp_path), fingerprint="d", files={"rl_train": str(_parquet(tmp_path / "t.parquet"))})
    with pytest.raises(BadInputError, match=r"the RL train set \(.*t.parquet\) has 3 valid rows, fewer than "
                                            r"rl.trainer.train_batch_size=4 prompts per step"):
        check_rl_rows(rl, data)          # 3 rows read from the parquet footer
    check_rl_rows(rl, data.model_copy(update={"meta": {"rl_train_rows": 4}}))   # the data stage's count: 4 >= 4
    check_rl_rows(rl.model_copy(update={"enabled": False}), data)               # RL off: nothing to check
