"""A cheap, bounded pre-screen of a model-written math answer before math-verify sees it.

`screen_math(text)` returns None for an answer math-verify may try, or the reason it is refused (the answer then
scores as not equal, without a call). It runs in time linear in the text (each `^` looks at one bounded group)
and catches what makes sympy compute for minutes or hours, holding the GIL where no signal can interrupt it:

- longer than `MAX_MATH_CHARS`, or brackets nested deeper than `MAX_DEPTH` (the parsers recurse per level);
- control characters, surrogates, private-use or unassigned code points (no answer is written with them);
- TeX that reads, writes or defines things (`\\input`, `\\write18`, `\\def`, `\\catcode`, ...) and Python
  dunders (`__import__`): math-verify runs no TeX and its plain-expression path admits only digits and
  operators, but no answer needs them either;
- an integer exponent above `MAX_EXPONENT` (`2^{10^{7}}`), a numeric power tower whose value exceeds that
  (`10^{10^{10}}`; `2^{2^{4}}` = 2^16 passes), a factorial of more than `MAX_FACTORIAL` (`100000!`) or of a
  numeric power / factorial (`(10^{10})!`, `((5!)!)!`), an exponent that is a numeric factorial (`2^{5000!}`).

The screen is conservative (a symbolic tower such as `e^{x^2}` passes) and not complete: whatever it misses is
still cut off by the scoring worker's hard time limit (stages/agent/math_worker.py). Its job is to make the usual
hostile answers cost microseconds instead of a killed and restarted worker.
"""

from __future__ import annotations

import math
import re
import unicodedata

MAX_MATH_CHARS = 1000
MAX_DEPTH = 30
MAX_EXPONENT = 100_000     # 2^100000 is a 30k-digit integer: milliseconds; 2^(10^7) is seconds, then worse
MAX_FACTORIAL = 5_000      # 5000! has 16k digits (milliseconds); 100000! takes seconds
_OPEN, _CLOSE = "({[", ")}]"
_BAD_CATEGORIES = {"Cc", "Cs", "Co", "Cn"}
_TEX_CODE = re.compile(
    r"\\(?:input|include|write|immediate|openin|openout|read|closein|closeout|def|gdef|edef|xdef|let|"
    r"newcommand|renewcommand|providecommand|DeclareMathOperator|catcode|csname|expandafter|usepackage|"
    r"documentclass|special|directlua|ShellEscape|loop|jobname|string|verbatim)(?![a-zA-Z])")
_NUMBER = re.compile(r"[+-]?\d+(?:\.\d+)?")
_NUMERIC_TOWER = re.compile(r"[+-]?\d+(?:\.\d+)?(?:\^[+-]?\d+(?:\.\d+)?)+")
_FACTORIAL_OF_NUMBER = re.compile(r"(\d+)\s*!")


def screen_math(text: str) -> str | None:
    """None when `text` may go to math-verify, else why it is refused (it then scores as not equal)."""
    if len(text) > MAX_MATH_CHARS:
        return f"longer than {MAX_MATH_CHARS} characters"
    for ch in text:
        if ch not in "\t\n\r" and unicodedata.category(ch) in _BAD_CATEGORIES:
            return f"contains the code point U+{ord(ch):04X}"
    if (code := _TEX_CODE.search(text)) is not None:
        return f"contains the TeX command {code.group(0)}"
    if "__" in text:  # Python dunders (`__import__`): sympy's string parser evaluates Python
        return "contains '__'"
    flat = text.replace("**", "^").replace("\\left", "").replace("\\right", "")
    closing = _matching_brackets(flat)
    if isinstance(closing, str):
        return closing
    return _huge_power(flat, closing) or _huge_factorial(flat, closing)


def _matching_brackets(text: str) -> dict[int, int] | str:
    """{index of an opening bracket: index of its closing one}, or the refusal when nesting is too deep.
    Unbalanced brackets are left unmatched (math-verify refuses those itself)."""
    stack: list[int] = []
    pairs: dict[int, int] = {}
    for i, ch in enumerate(text):
        if ch in _OPEN:
            stack.append(i)
            if len(stack) > MAX_DEPTH:
                return f"brackets nested deeper than {MAX_DEPTH}"
        elif ch in _CLOSE and stack and _OPEN[_CLOSE.index(ch)] == text[stack[-1]]:
            pairs[stack.pop()] = i
    return pairs


def _atom_after(text: str, start: int, closing: dict[int, int]) -> str:
    """The operand that starts at `start` (after `^`): a bracket group's content, a number with the power chain
    it starts (`9^9^9` is read right-associative, as math-verify's plain-expression parser does), or one
    character."""
    while start < len(text) and text[start] == " ":
        start += 1
    if start >= len(text):
        return ""
    if start in closing:
        return text[start + 1:closing[start]]
    number = _NUMBER.match(text, start)
    if number is None:
        return text[start]
    end = number.end()
    while end + 1 < len(text) and text[end] == "^":
        if end + 1 in closing:
            end = closing[end + 1] + 1
        elif (more := _NUMBER.match(text, end + 1)) is not None:
            end = more.end()
        else:
            break
    return text[start:end]


def _numeric_log10(atom: str) -> float | None:
    """log10 of a purely numeric atom (`123`, `10^{10}`, `(2^3)^4` flattened as a right-associative tower),
    math.inf when it is astronomically large, None when the atom is not purely numeric."""
    flat = re.sub(r"[\s{}()\[\]]", "", atom)
    if _NUMBER.fullmatch(flat):
        value = abs(float(flat))
        return math.log10(value) if value > 0 else -math.inf
    if not _NUMERIC_TOWER.fullmatch(flat):
        return None
    exponent = abs(float(flat.split("^")[-1]))
    for base_text in reversed(flat.split("^")[:-1]):
        base = abs(float(base_text))
        if base <= 1:
            exponent = 1.0  # 0^x, 1^x: small whatever x is
            continue
        log_value = exponent * math.log10(base)
        if log_value > 300:
            return math.inf
        exponent = base ** exponent
    return math.log10(exponent) if exponent > 0 else -math.inf


def _huge_power(text: str, closing: dict[int, int]) -> str | None:
    limit = math.log10(MAX_EXPONENT)
    for i, ch in enumerate(text):
        if ch != "^":
            continue
        atom = _atom_after(text, i + 1, closing)
        log_exponent = _numeric_log10(atom.lstrip("+-"))
        if "!" in atom and not re.search(r"[a-zA-Z]", atom):  # 5000!^{5000!}
            return f"exponent {atom[:40]!r} is a factorial"
        if log_exponent is not None and log_exponent > limit:
            return f"exponent {atom[:40]!r} is above {MAX_EXPONENT}"
    return None


def _huge_factorial(text: str, closing: dict[int, int]) -> str | None:
    for match in _FACTORIAL_OF_NUMBER.finditer(text):
        if len(match.group(1)) > 6 or int(match.group(1)) > MAX_FACTORIAL:
            return f"factorial of {match.group(1)[:40]} (above {MAX_FACTORIAL})"
    opening = {end: start for start, end in closing.items()}
    for i, ch in enumerate(text):
        if ch != "!" or i == 0:
            continue
        j = i - 1
        while j >= 0 and text[j] in " !":
            j -= 1
        if j in opening:  # `(...)!`: refused when the group is a numeric power or factorial
            group = text[opening[j] + 1:j]
            log_value = _numeric_log10(group)
            if ("!" in group and not re.search(r"[a-zA-Z]", group)) or (
                    log_value is not None and log_value > math.log10(MAX_FACTORIAL)):
                return f"factorial of {group[:40]!r}"
    return None
