"""The one stop-string rule, for every place that decides where generation stopped.

Rule: generation stops at the stop string that is *completed first* in the text; when two are completed at the
same character, the longer one wins (it started first). A streaming generator (transformers, vLLM) stops at
exactly that string, so the text-level cut (`cut_at_stop`, for servers that ignore stop strings), the token-level
check of the in-process backends and verl's server (`StopMatcher`) and the eval loop's reading of a server's
reply all agree. For the protocol's tags (`</search>`, `</python>`, `</answer>`: none is a part of another) the
first completed is also the first started.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from stages.agent.protocol import ANSWER_STOP, STOP_TAGS


def first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(end, stop): the stop string completed first in `text` and the index just after it; None when none is."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = text.find(stop) if stop else -1
        if start < 0:
            continue
        end = start + len(stop)
        if best is None or end < best[0] or (end == best[0] and len(stop) > len(best[1])):
            best = (end, stop)
    return best


def cut_at_stop(text: str, stops: Sequence[str] = (*STOP_TAGS, ANSWER_STOP)) -> tuple[str, str | None]:
    """(text up to and including the first stop, that stop), or (text, None): for servers that ignore stop strings
    (ARPO eval bug 8.5.4), the client cuts the output itself."""
    hit = first_stop(text, stops)
    return (text, None) if hit is None else (text[:hit[0]], hit[1])


@dataclass
class StopMatcher:
    """The stop rule on token ids: is a stop string completed in the decoded tail of a segment's new tokens?

    A stop string of c characters lies within the last c + 1 tokens that completed it (every token decodes to at
    least one character except special tokens), so decoding a short tail per step is enough.
    """

    tokenizer: object
    stops: tuple[str, ...]
    _tail: int = field(init=False)

    def __post_init__(self) -> None:
        self._tail = max((len(s) for s in self.stops), default=0) + 2

    def match(self, segment_ids: Sequence[int]) -> str | None:
        if not self.stops or not segment_ids:
            return None
        text = self.tokenizer.decode(list(segment_ids[-self._tail:]), skip_special_tokens=False)
        hit = first_stop(text, self.stops)
        return None if hit is None else hit[1]
