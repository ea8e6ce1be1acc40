"""What the deep-search summariser adds to a run's bill (agent.search.summarizer, docs/eval.md "Search mode per
benchmark"): one summariser call per browsing search call, each writing at most `summarizer.max_tokens` tokens.

- RL (per step, per run): when agent.search.browse.enabled, every executed search call of a rollout browses, so
  the calls follow the "search calls" line (its bound, or its measured mean) one for one.
- Evaluation (per run): the benchmarks that browse (eval.browse, or every one with browse.enabled) with a
  summariser: answers x eval.max_search calls at most.
A summary already in the summary cache costs no call, and a failing call is retried (summarizer.max_retries), so
the real count sits below these lines unless the summariser fails.
"""

from __future__ import annotations

from stages.core.config.loader import RunConfig
from stages.cost.line import Line


def summarizer_lines(cfg: RunConfig, search_calls: Line) -> list[Line]:
    """RL per-step lines, from the estimate's "search calls" line; none when RL rollouts do not browse and
    summarise."""
    search = cfg.agent.search
    if not (cfg.rl.enabled and search.browse.enabled and search.summarizer.model):
        return []
    max_tokens = search.summarizer.max_tokens
    calls = Line("summariser calls", search_calls.per_step, search_calls.per_run, search_calls.basis,
                 search_calls.error, "one per search call (browsing); summary-cache hits send none")
    tokens = Line("summariser generated tokens", _times(calls.per_step, max_tokens), _times(calls.per_run, max_tokens),
                  calls.basis, calls.error, f"each summary at most agent.search.summarizer.max_tokens={max_tokens}")
    return [calls, tokens]


def eval_summarizer_lines(cfg: RunConfig, questions: dict[str, int | None]) -> list[Line]:
    """Evaluation lines (per run only) over the benchmarks that browse with a summariser."""
    from stages.eval.search_mode import browses

    ev, search = cfg.eval, cfg.agent.search
    if not (ev.enabled and search.summarizer.model):
        return []
    browsing = [name for name in questions if browses(ev, search, name)]
    known = {name: questions[name] for name in browsing if questions[name] is not None}
    if not browsing:
        return []
    if not known:
        return [Line("eval summariser calls", None, None, "unknown",
                     note=f"benchmark files not found here: {sorted(browsing)}")]
    calls = sum(known.values()) * ev.samples * ev.max_search
    where = f"served by the evaluation from {search.summarizer.path}" if search.summarizer.served_here else \
        f"at {search.summarizer.url}"
    missing = sorted(set(browsing) - set(known))
    note = (f"{', '.join(sorted(known))}: answers x eval.max_search={ev.max_search}; {where}"
            + (f"; not counted (files not here): {missing}" if missing else ""))
    return [Line("eval summariser calls", None, calls, "bound", note=note),
            Line("eval summariser generated tokens", None, calls * search.summarizer.max_tokens, "bound",
                 note=f"each summary at most agent.search.summarizer.max_tokens={search.summarizer.max_tokens}")]


def summarizer_assumption(cfg: RunConfig) -> str | None:
    """What one summariser prompt holds, for the plan's assumptions; None without a summariser."""
    search = cfg.agent.search
    if not search.summarizer.model:
        return None
    browse = search.browse
    return (f"summariser prompt: up to {browse.top_k} pages (agent.search.browse.top_k) of about "
            f"{2 * browse.passage_chars:,} characters each (browse.passage_chars on each side of the best sentence) "
            "plus the reasoning so far; its input tokens are not counted above")


def _times(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor
