"""The one stop-string rule (stages/agent/stops.py): the text cut, the token-tail matcher, the same answers."""

from __future__ import annotations

import pytest

from stages.agent.stops import StopMatcher, cut_at_stop, first_stop
from tests.unit.test_rl_rollout_fakes import ToyTokenizer

TAGS = ("</search>", "</python>", "</answer>")


@pytest.mark.parametrize(("text", "expected"), [
    ("<search>q</search> <result>junk", ("<search>q</search>", "</search>")),
    ("<python>1</python><search>q</search>", ("<python>1</python>", "</python>")),   # the earlier one
    ("<answer>\\boxed{1}</answer> extra", ("<answer>\\boxed{1}</answer>", "</answer>")),
    ("nothing", ("nothing", None)),
    ("<search>half</sea", ("<search>half</sea", None)),
])
def test_cut_at_stop_on_protocol_tags(text, expected):
    assert cut_at_stop(text, TAGS) == expected
    assert cut_at_stop(text) == expected  # the default stops are the protocol's tags and </answer>


def test_first_completed_wins_and_ties_go_to_the_longer():
    # "abcd" with stops ("bc", "abcd"): "bc" is completed at index 3, "abcd" only at 4 -> a streaming generator
    # stops at "bc" although "abcd" started first
    assert first_stop("abcd", ("abcd", "bc")) == (3, "bc")
    # "xab" with stops ("b", "ab"): both are completed at index 3 -> the longer, which started first
    assert first_stop("xab", ("b", "ab")) == (3, "ab")
    assert first_stop("xab", ("ab", "b")) == (3, "ab")  # the order of the stops does not matter
    assert first_stop("xyz", ("b", "")) is None         # an empty stop never matches


def test_token_matcher_agrees_with_the_text_cut():
    tok = ToyTokenizer()
    m = StopMatcher(tok, ("</search>", "</python>"))
    assert m.match(tok.chars("abc <search>x</sea")) is None
    assert m.match(tok.chars("abc <search>x</search>")) == "</search>"
    assert m.match(tok.encode("x</python>", add_special_tokens=False)) == "</python>"   # one multi-char token
    ids = tok.chars("a</python></search>")  # checked after every token, as a backend does: </python> fires first
    first = next(i for i in range(1, len(ids) + 1) if m.match(ids[:i]))
    # "a" + "</python>" = 10 characters, one token each
    assert (first, m.match(ids[:first])) == (10, "</python>")
    assert cut_at_stop(tok.decode(ids, skip_special_tokens=False), m.stops) == ("a</python>", "</python>")
    assert StopMatcher(tok, ()).match(tok.chars("</search>")) is None
