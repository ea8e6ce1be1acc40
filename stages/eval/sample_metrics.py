"""Per-sample rule metrics and the reference's aggregate figures.

- QA: `em`, `f1` (SQuAD normalisation, max over list golds: stages.agent.answer_match) and `acc` (cover match: a
  normalised gold occurs inside the normalised prediction, the reference's `acc`).
- Math: `math_equal` with math-verify, run in a **process pool** (`MathVerifier`): each task runs
  `answer_match.math_equivalent_local` (pre-screened, soft time limit) on a pool worker's main thread, and a
  task that overruns its hard limit has the pool killed and restarted (docs/eval.md "Bounded scoring").
- `effective_prediction`: the reference scores the last 5 lines of the output when no answer was extracted; an
  extracted answer has its `\\text{...}` unwrapped first (the reference's extraction does that for a boxed
  `\\text{}`), so `\\boxed{\\text{Frank Lowy}}` scores as `Frank Lowy`.
- `tool_productivity`: the reference's figure final_acc * calls / (calls + 0.1) * 100.

Which per-sample value is "accuracy" is the benchmark's headline metric, as the papers report it
(`BenchmarkSpec.headline`, decided in `sample_score`): `f1` for the knowledge-QA sets; `llm_equal` (the judge)
for the others, which without a judge falls back to math_equal (math) / F1 (qa). The binary `correct` used by
pass@k is llm_equal with a judge, else math_equal (math) / EM (qa).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stages.agent.answer_match import (
    exact_match,
    f1_score,
    math_equivalent_local,
    normalize_answer,
    unwrap_text,
)
from stages.core.log import get_logger, progress

log = get_logger(__name__)

FALLBACK_LINES = 5


def cover_match(prediction: str | None, golds: Sequence[str]) -> float:
    """1.0 when some normalised gold is a substring of the normalised prediction ("acc" in the reference)."""
    if not prediction:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(normalize_answer(g) and normalize_answer(g) in pred for g in golds))


def effective_prediction(prediction: str | None, output: str | None) -> tuple[str, bool]:
    """(text to score, used_fallback). `\\text{...}` in a prediction is unwrapped; an empty prediction falls back to
    the output's last 5 non-empty lines."""
    if prediction is not None and prediction.strip():
        return unwrap_text(prediction).strip(), False
    lines = [line for line in (output or "").splitlines() if line.strip()]
    return "\n".join(lines[-FALLBACK_LINES:]), True


def qa_metrics(prediction: str, golds: Sequence[str]) -> dict[str, float]:
    """EM, F1 and cover match, max over the golds (a gold's `\\text{...}` unwrapped too, e.g. MATH's `\\text{Evelyn}`)."""
    if not prediction:
        return {"em": 0.0, "f1": 0.0, "acc": 0.0}
    golds = [unwrap_text(g) for g in golds]
    return {"em": exact_match(prediction, golds), "f1": f1_score(prediction, golds),
            "acc": cover_match(prediction, golds)}


def sample_score(task_type: str, metrics: dict[str, float], judged: bool,
                 headline: str = "llm_equal") -> tuple[float, float]:
    """(accuracy score in [0, 1], binary correct) for one sample, per the documented rule."""
    rule = "math_equal" if task_type == "math" else "f1"
    correct = "llm_equal" if judged else ("math_equal" if task_type == "math" else "em")
    score = "f1" if headline == "f1" else ("llm_equal" if judged else rule)
    return float(metrics[score]), float(metrics[correct])


def tool_productivity(final_acc: float, mean_tool_calls: float) -> float:
    """The reference's `tool_productivity` (= m1m2): final_acc * calls / (calls + 0.1) * 100."""
    return final_acc * mean_tool_calls / (mean_tool_calls + 0.1) * 100.0


def _math_worker(prediction: str, golds: tuple[str, ...], timeout_s: float) -> bool:
    # in-process: this already is a killable pool process (math_equivalent would start a worker of its own)
    return math_equivalent_local(prediction, list(golds), timeout_s=timeout_s)


@dataclass(frozen=True)
class MathResult:
    equal: bool
    error: str | None = None


STARTUP_CEILING_S = 300.0  # a ceiling only a broken start reaches: a spawn and its imports take seconds


def _warm(worker: Callable[[str, tuple[str, ...], float], bool]) -> None:
    """Nothing to do: unpickling `worker` (by name) in the child has imported its module."""


class MathVerifier:
    """math-verify in a pool of spawned processes; a hung item is cut off and scored False with an error.

    `with MathVerifier(workers=2) as mv: mv.check([(pred, golds), ...])`. An item gets `timeout_s` (the soft
    limit inside the worker) per text it parses plus `slack_s` (a loaded box's overhead; the pool's start-up is
    waited for before any item, up to `startup_s`); past that its pool is
    killed and restarted for the items after it, so one pathological expression cannot stall the rest.
    `worker` (a module-level function, it is pickled by name) exists for tests.
    """

    def __init__(self, workers: int = 2, timeout_s: float = 5.0, slack_s: float = 30.0,
                 worker: Callable[[str, tuple[str, ...], float], bool] | None = None,
                 startup_s: float = STARTUP_CEILING_S) -> None:
        self.workers = max(1, workers)
        self.timeout_s = timeout_s
        self.slack_s = slack_s
        self.startup_s = startup_s
        self.worker = worker or _math_worker
        self._pool = None

    def __enter__(self) -> MathVerifier:
        """Start the pool and wait until every worker has imported the worker's module, so that no item's limit
        pays for a spawn and its imports (seconds on a loaded box)."""
        self._pool = multiprocessing.get_context("spawn").Pool(processes=self.workers)
        try:
            self._pool.map_async(_warm, [self.worker] * self.workers, chunksize=1).get(timeout=self.startup_s)
        except multiprocessing.TimeoutError:
            self.__exit__()
            raise RuntimeError(f"math-verify's {self.workers} worker processes did not start within "
                               f"{self.startup_s:g} s; is the box out of memory or processes?") from None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def check(self, pairs: Sequence[tuple[str, Sequence[str]]]) -> list[MathResult]:
        if self._pool is None:
            raise RuntimeError("MathVerifier.check called outside `with MathVerifier(...) as mv:`")
        results: list[MathResult | None] = [None] * len(pairs)
        start = 0
        with progress() as bar:
            task = bar.add_task("math-verify", total=len(pairs))
            while start < len(pairs):
                start = self._run_from(pairs, start, results, lambda: bar.advance(task))
        return [r if r is not None else MathResult(False, "not run") for r in results]

    def _run_from(self, pairs: Sequence[tuple[str, Sequence[str]]], start: int, results: list,
                  advance: Callable[[], None]) -> int:
        """Submit pairs[start:], collect them in order; on a hang restart the pool and return where to resume."""
        pending = [(i, self._pool.apply_async(self.worker, (pairs[i][0], tuple(pairs[i][1]), self.timeout_s)))
                   for i in range(start, len(pairs))]
        for i, future in pending:
            limit = self.timeout_s * (2 * len(pairs[i][1]) + 1) + self.slack_s
            try:
                results[i] = MathResult(bool(future.get(timeout=limit)))
            except multiprocessing.TimeoutError:
                log.warning("math-verify gave no answer in %.0f s for %r; scored as not equal, pool restarted",
                            limit, pairs[i][0][:80])
                results[i] = MathResult(False, f"math-verify timed out after {limit:g} s")
                advance()
                self.__exit__()
                self.__enter__()
                return i + 1
            except Exception as err:  # noqa: BLE001 - a crash inside math-verify on odd input scores False, with a note
                results[i] = MathResult(False, f"{type(err).__name__}: {err}")
            advance()
        return len(pairs)
