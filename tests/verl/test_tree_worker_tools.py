"""The real ToolBox inside verl's agent-loop worker (issue 55): the python sandbox and the replay search called from
the worker's tree threads (stages/rl/verl/agent_loop.py `_executor`) through the worker's one shared ToolBox (its
tool pool and SQLite cache: stages/rl/verl/tree.py `shared_toolbox`), branch draws after real tool results, and a
sandbox that cannot start, whose infrastructure failures leave the worker as masked rows (all-zero
`response_mask`, `arpo_masked`) rather than as the policy's errors.

The scripted server (tests/verl/test_tree_worker.py) writes a python call first, a search call after its result,
and an answer after the second result. The toy tokenizer spells printable ASCII only, so the recorded searches are
a small replay file in that alphabet (the replay backend's format). A sandbox is broken the project's way
(tests/unit/test_agent_faults.py): a start-up limit no interpreter meets, so every call ends `start_failed` before
any code runs.
"""

from __future__ import annotations

import json

import pytest

from tests.unit.test_rl_rollout_fakes import ToyTokenizer
from tests.verl.test_tree_worker import ANSWERS, make_worker, run_prompt, sample, stored

pytestmark = pytest.mark.verl
QUERY, PAGE = "capital of france", "Page 1: Paris is the capital of France."


def script(context: str, seed: int) -> str:
    """One python call, one search call after its result, an answer after the second result."""
    results = context.count("<result>")
    if results == 0:
        return "<think>a</think><python>print(6*7)</python>"
    if results == 1:
        return f"<search>{QUERY}</search>"
    return ANSWERS[seed % 2] + "\x00"


@pytest.fixture
def agent(tmp_path):
    """Both tools, replay search (no network), no preloads (a quick sandbox start)."""
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps({QUERY: PAGE}))
    return lambda **python: {"python": {"preload": [], **python},
                             "search": {"backend": "replay", "replay_path": str(replay)}}


def rows_of(store) -> list[dict]:
    tok = ToyTokenizer()
    keys, data = stored(store)
    rows = []
    for r, extra in enumerate(data["extra_fields"]):
        ids, mask = data["responses"][r].tolist(), data["response_mask"][r].tolist()
        rows.append({"key": keys[r], "extra": extra, "mask": mask, "text": tok.decode(ids)})
    return rows


def test_the_sandbox_and_replay_search_run_from_the_workers_tree_threads(tiny_verl_config, settings_file,
                                                                        monkeypatch, agent):
    from stages.rl.verl.tree import shared_toolbox

    settings = settings_file(agent=agent(), call_limit=2)
    worker, server, store = make_worker(tiny_verl_config, monkeypatch, script, real_tools=True)
    run_prompt(worker, sample())
    rows = rows_of(store)
    assert [r["key"] for r in rows] == ["u1_0_0", "u1_1_0", "u1_2_0", "u1_3_0"]
    assert store["status"] == [("u1", "running"), ("u1", "finished")]
    for row in rows:
        assert "<result>\n42\n</result>" in row["text"]                        # print(6*7) ran in the sandbox
        assert PAGE in row["text"]           # the recorded search result
        assert row["extra"]["arpo_tool_calls"] == 2 and row["extra"]["arpo_masked"] == 0
        assert json.loads(row["extra"]["arpo_calls_by_tool"]) == {"python": 1, "search": 1}   # tools/<tool>_per_traj
        assert 0 < sum(row["mask"]) < len(row["mask"])                          # model tokens trained, results not
    metrics = shared_toolbox(settings).metrics()                                 # the worker's one ToolBox
    assert metrics["python_calls"] > 0 and metrics["search_calls"] > 0 and metrics["infra_failures"] == 0
    # branch copies forked after a real tool result: the draw that made each copy follows a call
    from stages.rl.tree_record import extra_tree_fields

    tok, (_, data) = ToyTokenizer(), stored(store)
    trees = [extra_tree_fields(r["extra"], data["responses"][i].tolist(), r["mask"], tok) for i, r in enumerate(rows)]
    made = [d for t in trees for d in t["tree"]["draws"] if d["branch"]]
    assert made and all(d["call"] >= 1 for d in made)
    assert {(d["child"], d["at"]) for d in made} == {
        (r["extra"]["arpo_tree_index"], r["extra"]["arpo_fork_at"]) for r in rows if r["extra"]["arpo_kind"] == "branch"}


def test_a_sandbox_that_cannot_start_masks_the_rows_of_its_calls(tiny_verl_config, settings_file, monkeypatch,
                                                                 agent):
    from stages.rl.verl.tree import shared_toolbox

    settings = settings_file(agent=agent(startup_timeout_s=0.001), call_limit=2)
    worker, _, store = make_worker(tiny_verl_config, monkeypatch, script, real_tools=True)
    run_prompt(worker, sample())
    rows = rows_of(store)
    assert len(rows) == 4 and store["status"] == [("u1", "running"), ("u1", "finished")]   # stored, not dropped
    for row in rows:
        assert "the python sandbox failed to start" in row["text"]
        assert row["extra"]["arpo_masked"] == 1 and set(row["mask"]) == {0}      # out of the loss and the statistics
    assert sum(r["extra"]["arpo_infra_failures"] for r in rows) >= 2            # each root's own call (copies inherit)
    metrics = shared_toolbox(settings).metrics()
    assert metrics["python_infra_failures"] == metrics["python_calls"] > 0
    assert metrics["search_calls"] > 0 and metrics.get("search_infra_failures", 0) == 0   # search still ran
