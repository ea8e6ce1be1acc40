"""The lane guard of tests/conftest.py (issue 45): the end-of-run `[lanes]` lines that say what share of the two
xdist lanes' time each heavy module took, from the (module, lane, seconds) records the controller collects."""

from __future__ import annotations

from types import SimpleNamespace

import tests.conftest as conftest
from tests.conftest import lane_time_lines

VERL, PIPELINE = "tests/integration/test_rehearse_verl_e2e.py", "tests/integration/test_pipeline_e2e.py"
HEAVY = ("test_rehearse_verl_e2e.py", "test_pipeline_e2e.py", "test_ui_live.py")


def test_each_heavy_module_gets_its_seconds_share_and_lanes() -> None:
    records = [(VERL, "gw0", 900.0), (VERL, "gw0", 100.0),        # set-up + call: 1000 s, on gw0 only
               (PIPELINE, "gw1", 600.0),
               ("tests/unit/test_a.py", "gw0", 200.0), ("tests/unit/test_a.py", "gw1", 180.0),   # on both lanes
               ("tests/unit/test_b.py", "gw1", 20.0)]
    # total 1000 + 600 + 380 + 20 = 2000 s; gw0 = 900 + 100 + 200 = 1200 s, gw1 = 600 + 180 + 20 = 800 s.
    # Shares of 2000 s: verl 50.0%, pipeline 30.0%, test_a 19.0% (>= 5%: shown although not heavy), test_b 1.0%
    # (< 5%, not heavy: folded into the rest). test_ui_live.py is heavy but has no record: no line.
    assert lane_time_lines(records, HEAVY, min_share=0.05) == [
        "[lanes] 2000 s of test time (set-up + call + teardown) over 2 lanes: gw0 1200 s, gw1 800 s",
        "[lanes] tests/integration/test_rehearse_verl_e2e.py: 1000 s, 50.0% (gw0 1000 s)",
        "[lanes] tests/integration/test_pipeline_e2e.py: 600 s, 30.0% (gw1 600 s)",
        "[lanes] tests/unit/test_a.py: 380 s, 19.0% (gw0 200 s + gw1 180 s)",
        "[lanes] the other 1 module: 20 s, 1.0%",
    ]


def test_a_heavy_module_is_shown_below_the_threshold_and_one_process_is_one_lane() -> None:
    records = [("tests/integration/test_ui_live.py", "main", 10.0), ("tests/unit/test_c.py", "main", 90.0),
               ("tests/unit/test_d.py", "main", 100.0)]
    # total 200 s: test_d 50.0% (>= 50%: shown), test_c 45.0% (rest), test_ui_live 5.0% (heavy: shown anyway);
    # longest first, the rest last
    assert lane_time_lines(records, HEAVY, min_share=0.5) == [
        "[lanes] 200 s of test time (set-up + call + teardown) over 1 lane: main 200 s",
        "[lanes] tests/unit/test_d.py: 100 s, 50.0% (main 100 s)",
        "[lanes] tests/integration/test_ui_live.py: 10 s, 5.0% (main 10 s)",
        "[lanes] the other 1 module: 90 s, 45.0%",
    ]


def test_no_time_recorded_prints_nothing() -> None:
    assert lane_time_lines([], HEAVY) == []                              # e.g. --collect-only
    assert lane_time_lines([(VERL, "gw0", 0.0)], HEAVY) == []


def test_the_controller_records_each_phase_by_its_lane_and_a_worker_records_nothing(monkeypatch) -> None:
    records: list[tuple[str, str, float]] = []
    monkeypatch.setattr(conftest, "_LANE_RECORDS", records)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)           # the controller, or a run without workers
    conftest.pytest_runtest_logreport(SimpleNamespace(nodeid=f"{VERL}::test_x", duration=1.5, worker_id="gw1"))
    conftest.pytest_runtest_logreport(SimpleNamespace(nodeid=f"{VERL}::test_x", duration=0.5,
                                                      node=SimpleNamespace(gateway=SimpleNamespace(id="gw0"))))
    conftest.pytest_runtest_logreport(SimpleNamespace(nodeid="tests/unit/test_c.py::test_y[a::b]", duration=2.0))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")                    # a worker: its controller records it
    conftest.pytest_runtest_logreport(SimpleNamespace(nodeid=f"{VERL}::test_x", duration=9.0, worker_id="gw0"))
    assert records == [(VERL, "gw1", 1.5), (VERL, "gw0", 0.5), ("tests/unit/test_c.py", "main", 2.0)]
