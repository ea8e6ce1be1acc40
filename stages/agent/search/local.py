"""`local` search: BM25 (bm25s + PyStemmer) over a FlashRAG-format JSONL corpus.

Corpus rows are `{"id": ..., "contents": "Title\\ntext"}` (FlashRAG); `{"id", "title", "text"}` rows are accepted
too. The index is built once and cached under `<cache_root>/search-index/bm25-<corpus fingerprint>/`, written
atomically, so concurrent processes and later runs load it instead of rebuilding.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from stages.agent.search.base import Passage, SearchBackend
from stages.core.atomic import atomic_path, iter_json_objects, write_json
from stages.core.errors import BadInputError, MissingInputError
from stages.core.fingerprint import hash_file
from stages.core.log import get_logger

log = get_logger(__name__)
INDEX_VERSION = "bm25s-en-stem-1"  # bump when tokenisation or stored layout changes


def corpus_fingerprint(path: str | Path, cache_root: str | Path) -> str:
    """sha256 of the corpus file (16 hex), memoised by (path, size, mtime) so a big corpus is hashed once."""
    path = Path(path).resolve()
    stat = path.stat()
    memo = Path(cache_root) / "search-index" / "fingerprints.json"
    key = f"{path}:{stat.st_size}:{stat.st_mtime_ns}"
    known: dict[str, str] = {}
    if memo.is_file():
        try:
            known = json.loads(memo.read_text())
        except (OSError, json.JSONDecodeError):
            known = {}
    if key not in known:
        known[key] = hash_file(path)[:16]
        write_json(memo, known)
    return known[key]


def read_corpus(path: str | Path) -> list[dict[str, str]]:
    """FlashRAG JSONL rows as `{"id", "contents"}`; a bad row raises naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise MissingInputError(f"search corpus {path} does not exist; set agent.search.corpus_path to a FlashRAG "
                                "JSONL file ({\"id\", \"contents\"} per line) or run the data stage")
    docs = []
    for lineno, row in iter_json_objects(path):
        if "contents" in row:
            contents = row["contents"]
        elif "text" in row:
            contents = f"{row.get('title', '')}\n{row['text']}".strip()
        else:
            raise BadInputError(f"{path}:{lineno}: a corpus row needs 'contents' (FlashRAG) or 'title'+'text'; "
                            f"it has {sorted(row)}")
        docs.append({"id": str(row.get("id", lineno - 1)), "contents": str(contents)})
    if not docs:
        raise BadInputError(f"search corpus {path} has no documents")
    return docs


def _stemmer():
    import Stemmer

    return Stemmer.Stemmer("english")


def _tokenize(texts: list[str], stemmer, as_ids: bool):
    import bm25s

    return bm25s.tokenize(texts, stopwords="en", stemmer=stemmer, return_ids=as_ids,
                          show_progress=as_ids and sys.stderr.isatty())


def build_index(docs: list[dict[str, str]], folder: Path) -> None:
    """Index `docs` with BM25 and save index + corpus into `folder` (atomically)."""
    import bm25s

    retriever = bm25s.BM25()
    retriever.index(_tokenize([d["contents"] for d in docs], _stemmer(), True), show_progress=sys.stderr.isatty())
    with atomic_path(folder) as tmp:
        tmp.mkdir(parents=True)
        retriever.save(str(tmp), corpus=docs, show_progress=False)
        (tmp / "meta.json").write_text(json.dumps({"version": INDEX_VERSION, "documents": len(docs)}))


class BM25Backend(SearchBackend):
    """BM25 over a JSONL corpus; the index is cached by the corpus fingerprint."""

    name = "local"

    def __init__(self, corpus_path: str | Path, cache_root: str | Path) -> None:
        import bm25s

        self.corpus_path = Path(corpus_path)
        fingerprint = corpus_fingerprint(corpus_path, cache_root)
        self.corpus_id = f"bm25:{fingerprint}"
        self.index_dir = Path(cache_root) / "search-index" / f"bm25-{fingerprint}-{INDEX_VERSION}"
        if not (self.index_dir / "meta.json").is_file():
            docs = read_corpus(corpus_path)
            log.info("building the BM25 index of %s (%d documents) in %s", corpus_path, len(docs), self.index_dir)
            build_index(docs, self.index_dir)
        self._retriever = bm25s.BM25.load(str(self.index_dir), load_corpus=True, mmap=False, show_progress=False)
        self._docs = list(self._retriever.corpus)
        self._retriever.corpus = None  # retrieve() then returns row indices, which we map to documents
        self._stemmer = _stemmer()
        self.size = len(self._docs)

    def _top(self, tokens: list[str], k: int) -> list[Passage]:
        """bm25s scores the corpus; numpy picks the top k (10x faster than bm25s.retrieve's per-call
        thread pool at this size). Ties go to the lower row; zero scores (no term matched) are dropped."""
        import numpy as np

        ids = self._retriever.get_tokens_ids(tokens)
        if not ids:
            return []
        scores = self._retriever.get_scores_from_ids(ids)
        k = min(k, len(scores))
        top = np.argpartition(-scores, k - 1)[:k]
        top = top[np.lexsort((top, -scores[top]))]
        return [Passage(str(self._docs[i]["id"]), self._docs[i]["contents"], float(scores[i]))
                for i in top.tolist() if scores[i] > 0]

    def batch_search(self, queries: list[str], top_k: int) -> list[list[Passage]]:
        if not queries:
            return []
        tokens = _tokenize(list(queries), self._stemmer, False)
        return [self._top(list(t), top_k) for t in tokens]

    def search(self, query: str, top_k: int) -> list[Passage]:
        return self.batch_search([query], top_k)[0]
