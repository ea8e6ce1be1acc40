"""The eval table while it fills in (stages.eval.report.progress_rows): configured order, scored rows in percent."""

from __future__ import annotations

from stages.eval.report import progress_rows


def test_rows_fill_in_as_benchmarks_are_scored():
    summary = {"questions": 4, "samples_per_question": 2, "accuracy_metric": "f1",
               "metrics": {"accuracy": {"value": 0.375, "ci_low": 0.1, "ci_high": 0.6},
                           "pass@2": {"value": 0.5, "ci_low": 0.0, "ci_high": 1.0}}}
    rows = progress_rows(["gsm8k", "synthetic"], {"synthetic": summary})
    assert rows == [{"benchmark": "gsm8k", "status": "running"},
                    {"benchmark": "synthetic", "status": "scored", "questions": 4, "samples": 2, "metric": "f1",
                     "accuracy": 37.5, "pass@2": 50.0}]
