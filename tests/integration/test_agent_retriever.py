"""`arpo retriever serve` as a real process on loopback, used by the `server` search backend and the ToolBox."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from stages.agent.protocol import ToolCall
from stages.agent.search.local import BM25Backend
from stages.agent.search.server import ServerBackend
from stages.agent.toolbox import ToolBox
from stages.core.config.agent import AgentSection
from stages.core.env import PROJECT_ROOT

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def served(tmp_path_factory, shared_data):
    """A corpus made of the shared search-cache passages, served by `main(argv)` in its own process."""
    folder = tmp_path_factory.mktemp("retriever")
    cache = json.loads((shared_data / "search_cache.json").read_text())
    rows = []
    for value in list(cache.values())[:200]:
        for line in value.splitlines():
            if line.startswith("Page "):
                rows.append({"id": f"doc-{len(rows)}", "contents": line.split(": ", 1)[1]})
    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = "import sys; from stages.agent.retriever_server import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, "--corpus", str(corpus), "--cache-root", str(folder),
                             "--port", str(port)], cwd=PROJECT_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"retriever server did not come up: {proc.stdout.read()[-2000:]}")
        time.sleep(0.2)
    yield url, corpus, folder
    proc.terminate()
    proc.wait(timeout=30)


def test_server_matches_local_backend(served):
    url, corpus, folder = served
    local = BM25Backend(corpus, folder)  # loads the index the server built (same fingerprint)
    remote = ServerBackend(url)
    assert remote.corpus_id == local.corpus_id
    for query in ("Campfire Tales film debut", "Who directed Love Finds Andy Hardy", "Yayoi Kusama book"):
        assert [p.id for p in remote.search(query, 5)] == [p.id for p in local.search(query, 5)]
    batch = remote.batch_search(["Amy Smart", "Yuri Ozerov nationality"], 3)
    assert [[p.id for p in r] for r in batch] == [[p.id for p in local.search(q, 3)]
                                                  for q in ("Amy Smart", "Yuri Ozerov nationality")]
    remote.close()


def test_toolbox_over_server(served, tmp_path):
    url, _, _ = served
    cfg = AgentSection.model_validate({"prompt_template": "tir_search",
                                       "search": {"backend": "server", "server_url": url, "top_k": 3}})
    with ToolBox.from_config(cfg, None, str(tmp_path)) as box:
        result = box.execute(ToolCall("search", "Campfire Tales Amy Smart"), box.new_state())
    assert result.ok and result.text.startswith("Page 1: ") and result.text.count("\nPage ") == 2
