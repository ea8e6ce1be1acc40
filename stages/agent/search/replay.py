"""`replay` search: answers from a recorded `{query: formatted_result}` JSON (e.g. ../shared/data/search_cache.json).

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


def replay_key(query: str) -> str:
    return normalize_query(query).casefold()


class ReplayBackend(SearchBackend):
    name = "replay"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"replay file {self.path} does not exist; set agent.search.replay_path to a "
                                    "{query: result} JSON such as ../shared/data/search_cache.json")
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{self.path}: not valid JSON ({err.msg} at line {err.lineno})") from err
        if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
            raise ValueError(f"{self.path}: expected one JSON object mapping query strings to result strings")
        self.results: dict[str, str] = {}
        for query, result in raw.items():
            self.results.setdefault(replay_key(query), result)
        self.corpus_id = f"replay:{hash_file(self.path)[:16]}"

    def search(self, query: str, top_k: int) -> list[Passage]:
        key = replay_key(query)
        if key not in self.results:
            raise SearchMiss(f"no recorded search result for {normalize_query(query)!r} in {self.path}")
        return parse_formatted(self.results[key])[:top_k]

    def __len__(self) -> int:
        return len(self.results)
