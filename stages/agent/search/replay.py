"""`replay` search: answers from a recorded `{query: formatted_result}` JSON (e.g. ../shared/data/search_cache.json).
A value may instead be a list of `{"url", "title", "snippet"}` results: those keep their page addresses, so
browsing (agent.search.browse, with a recorded page set) runs offline too.

Queries and keys are matched after `normalize_query` and case-folding, so `search query: Who …` finds `Who …`.
A query that was never recorded raises SearchMiss: replay never invents a result.
"""

from __future__ import annotations

import json
from pathlib import Path

from stages.agent.search.base import (
    Passage,
    SearchBackend,
    SearchMiss,
    normalize_query,
    parse_formatted,
)
from stages.core.fingerprint import hash_file
from stages.core.input_files import resolve


def _is_results(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(r, dict) for r in value)


def replay_key(query: str) -> str:
    return normalize_query(query).casefold()


class ReplayBackend(SearchBackend):
    name = "replay"

    def __init__(self, path: str | Path) -> None:
        # relative to the project root as everywhere (stages/core/input_files.py), not to the process's working folder:
        # verl's agent-loop workers run in Ray's (found by the first verl rehearsal)
        self.path = resolve(str(path), project_relative=True)
        if not self.path.is_file():
            raise FileNotFoundError(f"replay file {self.path} does not exist; set agent.search.replay_path to a "
                                    "{query: result} JSON such as ../shared/data/search_cache.json")
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{self.path}: not valid JSON ({err.msg} at line {err.lineno})") from err
        if not isinstance(raw, dict) or not all(isinstance(v, str) or _is_results(v) for v in raw.values()):
            raise ValueError(f"{self.path}: expected one JSON object mapping query strings to result strings (or to "
                             "lists of {\"url\", \"title\", \"snippet\"} objects)")
        self.results: dict[str, str | list[dict]] = {}
        for query, result in raw.items():
            self.results.setdefault(replay_key(query), result)
        self.corpus_id = f"replay:{hash_file(self.path)[:16]}"

    def search(self, query: str, top_k: int) -> list[Passage]:
        key = replay_key(query)
        if key not in self.results:
            raise SearchMiss(f"no recorded search result for {normalize_query(query)!r} in {self.path}")
        found = self.results[key]
        if isinstance(found, str):
            return parse_formatted(found)[:top_k]
        return [Passage(str(r.get("url") or f"page-{i}"), str(r.get("snippet", "")), title=str(r.get("title", "")),
                        url=str(r.get("url", ""))) for i, r in enumerate(found[:top_k], start=1)]

    def __len__(self) -> int:
        return len(self.results)
