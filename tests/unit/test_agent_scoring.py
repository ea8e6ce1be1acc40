"""Answer scoring primitives: normalisation, gold parsing, EM, F1, math equivalence."""

from __future__ import annotations

import threading

import pytest

from stages.agent.answer_match import (
    MAX_MATH_CHARS,
    exact_match,
    f1_score,
    math_equivalent,
    normalize_answer,
    parse_gold,
    unwrap_text,
)


@pytest.mark.parametrize("text, expected", [
    ("The Eiffel Tower!", "eiffel tower"),
    ("  A  cat, an apple;  THE end ", "cat apple end"),
    ("\\frac{1}{2}", "frac12"),  # the reference's math-as-text quirk (docs/reference.md "Reward")
    ("theatre", "theatre"),  # 'the' only as a whole word
])
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


@pytest.mark.parametrize("gold, expected", [
    ("['Frank Lowy']", ["Frank Lowy"]),
    ("['Frank Lowy', \"Lowy\"]", ["Frank Lowy", "Lowy"]),
    (["a", 3], ["a", "3"]),
    ("Paris", ["Paris"]),
    ("[not a list", ["[not a list"]),
    ("[1, 2] is an interval", ["[1, 2] is an interval"]),
    ("[x]", ["[x]"]),  # not a Python literal -> one answer
    (18, ["18"]),
])
def test_parse_gold(gold, expected):
    assert parse_gold(gold) == expected


def test_parse_gold_errors():
    with pytest.raises(ValueError, match="None"):
        parse_gold(None)
    with pytest.raises(ValueError, match="empty"):
        parse_gold([])


def test_exact_match():
    assert exact_match("the Frank Lowy.", "['Frank Lowy']") == 1.0
    assert exact_match("Lowy", ["Frank Lowy", "Lowy"]) == 1.0
    assert exact_match("Frank", "Frank Lowy") == 0.0
    assert exact_match(None, "x") == 0.0


def test_f1_score_hand_values():
    # pred tokens {frank, lowy, jr}, gold {frank, lowy}: common 2, P = 2/3, R = 1, F1 = 2*(2/3)/(5/3) = 0.8
    assert f1_score("Frank Lowy Jr", "Frank Lowy") == pytest.approx(0.8, abs=1e-12)
    # max over golds: vs "Lowy" P = 1/3, R = 1 -> 0.5; vs "Frank Lowy" 0.8 -> 0.8
    assert f1_score("Frank Lowy Jr", ["Lowy", "Frank Lowy"]) == pytest.approx(0.8, abs=1e-12)
    # repeated tokens count with multiplicity: pred [a1, a1] (articles gone), gold [a1]: common 1, P = 1/2, R = 1
    assert f1_score("a1 a1", "a1") == pytest.approx(2 * 0.5 * 1 / 1.5, abs=1e-12)
    assert f1_score("Berlin", "Paris") == 0.0
    assert f1_score(None, "x") == 0.0


def test_f1_yes_no_rule():
    # "yes" vs "yes it is": normally P = 1, R = 1/3 -> 0.5, but the yes/no rule forces 0
    assert f1_score("yes", "yes it is") == 0.0
    assert f1_score("yes it is", "yes") == 0.0
    assert f1_score("Yes.", "yes") == 1.0
    assert f1_score("no", "['no']") == 1.0


@pytest.mark.parametrize("pred, gold, expected", [
    ("0.5", "\\frac{1}{2}", True),
    ("\\frac{1}{2}", "0.5", True),
    ("18", "18", True),
    ("18", "17", False),
    ("1+x^2", "x^2+1", True),  # bare strings are wrapped in $…$ (bare '1+x^2' would parse as 1)
    ("3\\sqrt{2}", "\\sqrt{18}", True),
    ("\\{1,2\\}", "\\{2,1\\}", True),
    ("12", "['11', '12']", True),  # any gold
    ("", "1", False),
    (None, "1", False),
    ("Paris", "London", False),
    # an escaped dollar is a currency sign (the reference's strip_string drops it), not a math delimiter
    ("18.90", "\\$18.90", True),
    ("\\$18", "18", True),
    ("36", "\\$36", True),
    ("\\$32,348", "\\$32,\\!348", True),   # thousands separator and thin space as MATH writes it
    ("17", "\\$18", False),
])
def test_math_equivalent(pred, gold, expected):
    assert math_equivalent(pred, gold) is expected


def test_math_equivalent_off_main_thread():
    results = {}

    def worker():
        results["eq"] = math_equivalent("0.5", "\\frac{1}{2}")
        results["long"] = math_equivalent("1" * (MAX_MATH_CHARS + 1), "1")

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(60)
    # works from a worker thread (math-verify's signal timeouts would raise ValueError there)
    assert results == {"eq": True, "long": False}


@pytest.mark.parametrize("text, expected", [
    ("\\text{Frank Lowy}", "Frank Lowy"),
    ("5.4 \\text{ cents}", "5.4  cents"),
    ("\\text{(C)}", "(C)"),
    ("\\textbf{\\text{A}} and \\mathrm{B}", "A and B"),   # nested and other text macros
    ("\\text{open", "\\text{open"),                        # unbalanced: left alone
    ("x^{2} + \\frac{1}{2}", "x^{2} + \\frac{1}{2}"),       # other braces untouched
])
def test_unwrap_text(text, expected):
    assert unwrap_text(text) == expected
