"""The repo explains itself: no tracked file cites notes that live outside it.

A fact taken from outside (the reference code, a measurement made while building the install) goes into docs/
with its upstream source (repository, commit, file:line): docs/reference.md, docs/decisions.md. Citing a path
outside the checkout (the design notes, research notes, the machine's shared folder) leaves the next reader with
a pointer they cannot follow. The one outside path allowed is the real data's default location, `../shared/data`
(an input the configs read, documented in the README's "Data" section), not a citation.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from stages.core.env import PROJECT_ROOT

# Built from pieces so that this file does not match itself.
_SHARED = r"\.\./" + "shared"
CITATION = re.compile(
    "|".join([
        _SHARED + r"/(?!data\b)",            # ../shared/<anything but data>
        _SHARED + r"(?![/\w])",              # ../shared on its own
        "/work/" + "shared",                 # the machine's shared folder
        r"research/[A-Za-z_]+\." + "md",     # research notes
        "DESIGN" + r"\.md",                  # the design notes
    ])
)


def tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=PROJECT_ROOT, capture_output=True, check=True).stdout
    return [PROJECT_ROOT / name for name in out.decode().split("\0") if name]


def citations(text: str) -> list[tuple[int, str]]:
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if CITATION.search(line)]


def test_the_pattern_catches_each_kind_of_citation_and_allows_the_data_path():
    cited = ["see " + "../shared/" + "DESIGN.md", "(research/" + "arpo.md 4.1)", "/work/" + "shared/data/x",
             "research/" + "feasibility.md section 2", "../" + "shared/hooks/x.sh", "cd ../" + "shared"]
    allowed = ["data_root: ../shared/data/eval", "e.g. ../shared/data/search_cache.json", "docs/reference.md",
               "the shared prefix", "research notes"]
    assert [bool(CITATION.search(s)) for s in cited] == [True] * len(cited)
    assert [bool(CITATION.search(s)) for s in allowed] == [False] * len(allowed)


def test_no_tracked_file_cites_a_path_outside_the_repo():
    me = Path(__file__).resolve()
    found = []
    for path in tracked_files():
        if path.resolve() == me or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary (images)
        found += [f"{path.relative_to(PROJECT_ROOT)}:{n}: {line}" for n, line in citations(text)]
    assert not found, ("these lines cite notes outside the repository; move the fact into docs/ with its upstream "
                       "source (repository, commit, file:line) and cite the docs page:\n" + "\n".join(found))
