"""Rule reward for math answers (docs/design.md §4): extract the final answer, check it against the gold.

Two layers, both pure (the process pool that runs them with deadlines is ``pace.grading``):

1. ``extract_answer`` – pure string work on the tail of the response (DAPO format
   ``Answer: ...``, falling back to the last ``\\boxed{...}``). Linear time, no regex that can
   backtrack, so it is safe on million-character or adversarial outputs.
2. ``check_answer`` / ``is_correct`` – a fast exact path for plain numbers ("025" == "25"),
   otherwise math-verify on both sides wrapped in ``$...$``. Never raise.

math-verify bounds its own work with ``signal.alarm``, which only works in the main thread of a
process, and a sympy computation stuck in C code ignores it; `pace.grading.Grader` therefore runs
``grade_batch`` in worker processes it can kill. This module imports math-verify lazily, so the
parent pays nothing for it until a worker (or a direct ``is_correct`` call) needs it.
"""
from __future__ import annotations

import re
import threading
from decimal import Decimal, InvalidOperation

# Only the end of a response can hold the final answer. DAPO's reference reward looks at the last
# 300 characters (the longest MATH-500 answer has 197); we keep 4,000 so long LaTeX answers and a
# little trailing chatter still fit, while a 1M-character output costs the same as a short one.
TAIL_CHARS = 4_000
# Answers longer than this are scored wrong without calling math-verify: no real answer is this
# long, and math-verify's regexes / sympy on such strings are where pathological time goes.
MAX_VERIFY_CHARS = 1_000
# math-verify's own per-call timeout inside a worker (whole seconds: it uses signal.alarm). Gold
# parses are cached, so one answer costs at most parse(pred) + verify = 2 s, under the default
# 5 s job deadline: one pathological answer loses its own point, not its whole job.
ANSWER_TIMEOUT_S = 1


# ---------------------------------------------------------------- extraction (pure)

_BOXED = "\\boxed{"


def _closing_brace(text: str, i: int) -> int | None:
    """Index of the ``}`` that closes the group whose content starts at ``i``; None if unbalanced.

    Escaped braces ``\\{`` ``\\}`` are skipped, so ``\\boxed{\\left\\{1\\right.}`` still closes.
    """
    depth = 1
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\" and i + 1 < n and text[i + 1] in "{}":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``; None if absent or if that one never closes
    (the model was cut off mid-answer: an earlier box is not its final answer)."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    end = _closing_brace(text, start + len(_BOXED))
    return None if end is None else text[start + len(_BOXED):end]


def _strip_decoration(s: str) -> str:
    """Strip whitespace, ``**``, a trailing period, ``$..$``, ``\\(..\\)``, ``\\[..\\]`` until stable.

    Only C-level string operations, and every pass shortens the string, so this stays fast even
    on thousands of nested ``$``.
    """
    while True:
        before = s
        s = s.strip().strip("*").strip()
        if s.endswith("."):
            s = s[:-1].rstrip()
        if len(s) >= 2 and s[0] == "$" and s[-1] == "$":
            s = s[1:-1]
        elif len(s) >= 4 and s[:2] in ("\\(", "\\[") and s[-2:] in ("\\)", "\\]"):
            s = s[2:-2]
        if s == before:
            return s


def _unwrap(s: str) -> str:
    """The bare answer: handles ``**Answer:** 42``, ``$42$.``, ``$$42$$``, ``\\(42\\)``, ``\\boxed{42}``.

    A whole-answer ``\\boxed{}`` is unwrapped once (a Python-level scan), not in a loop, so
    nested boxes cannot make this quadratic.
    """
    s = _strip_decoration(s)
    if s.startswith(_BOXED) and _closing_brace(s, len(_BOXED)) == len(s) - 1:
        s = _strip_decoration(s[len(_BOXED):-1])
    return s


def extract_answer(text: str) -> str | None:
    """The model's final answer, or None.

    DAPO format: what follows the LAST ``Answer:`` up to the end of that line (if the marker ends
    its line, the next non-empty line, as DAPO's ``Answer\\s*:\\s*([^\\n]+)`` does), stripped of
    whitespace, a trailing period, surrounding ``$`` (and ``**``, ``\\(..\\)``, a whole-answer
    ``\\boxed{}``). Without an ``Answer:``, the content of the last ``\\boxed{...}``.
    Only the last ``TAIL_CHARS`` characters are searched: an answer further back than that is
    not a final answer, and the cap makes the cost independent of the response length.
    """
    tail = text[-TAIL_CHARS:]
    i = tail.rfind("Answer:")
    if i >= 0:
        rest = tail[i + len("Answer:"):].lstrip()
        answer = _unwrap(rest.split("\n", 1)[0])
        if answer:
            return answer
    boxed = _last_boxed(tail)
    if boxed is None:
        return None
    return _unwrap(boxed) or None


# ---------------------------------------------------------------- correctness (pure)

# One optional sign, digits with an optional fraction. ASCII only: str.isdigit and \d without
# re.ASCII accept "²" and other digits that Decimal rejects. No nested quantifiers, so matching
# a 4,000-digit string is linear.
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)", re.ASCII)
# Thousands separators only in groups of three, so the tuple "1,2" never becomes 12.
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?", re.ASCII)


def _as_number(s: str) -> Decimal | None:
    """Exact value of a plain integer/decimal answer ("1,000", "025", "0.50", "1\\,000"), else None.

    Decimal, not int/float: exact for any length (int() refuses > 4,300 digits) and equal across
    leading/trailing zeros.
    """
    s = s.replace("{,}", ",").replace("\\,", "").replace("\\!", "").replace(" ", "")
    if "," in s:
        if not _THOUSANDS.fullmatch(s):
            return None
        s = s.replace(",", "")
    if not _NUMBER.fullmatch(s):
        return None
    try:
        return Decimal(s)
    except InvalidOperation:
        return None


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


_GOLD_CACHE: dict[tuple[str, int | None], list] = {}


def _parse_gold(gold: str, timeout: int | None) -> list:
    """math-verify parse of a gold answer, cached: a group of G responses shares one gold."""
    from math_verify import parse

    key = (gold, timeout)
    if key not in _GOLD_CACHE:
        if len(_GOLD_CACHE) >= 4096:  # bounded; golds repeat within a batch, not across a run
            _GOLD_CACHE.clear()
        _GOLD_CACHE[key] = parse(f"${gold}$", parsing_timeout=timeout)
    return _GOLD_CACHE[key]


def _math_verify(pred: str, gold: str, timeout: int | None) -> bool:
    from math_verify import parse, verify

    gold_parsed = _parse_gold(gold, timeout)
    if not gold_parsed:
        return False
    pred_parsed = parse(f"${pred}$", parsing_timeout=timeout)
    if not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


def check_answer(response: str, gold: str, timeout_s: int | None = ANSWER_TIMEOUT_S) -> bool | None:
    """Whether ``response``'s final answer equals ``gold``; None if grading it failed (an
    exception in extraction or math-verify). Never raises.

    Plain numbers on both sides are compared exactly; anything else goes to math-verify with
    ``timeout_s`` (whole seconds) on each parse/verify call. math-verify's timeout needs
    ``signal.alarm``, so off the main thread it is dropped (math-verify would otherwise raise,
    and every answer would silently score False) and the call is unbounded: threads should grade
    through ``pace.grading.Grader``, whose worker processes run this in their main thread.
    """
    try:
        pred = extract_answer(response)
        gold = _unwrap(gold)
        if pred is None or not gold:
            return False
        pred_num, gold_num = _as_number(pred), _as_number(gold)
        if pred_num is not None and gold_num is not None:
            return pred_num == gold_num
        if len(pred) > MAX_VERIFY_CHARS:
            return False
        return _math_verify(pred, gold, timeout_s if _in_main_thread() else None)
    except BaseException as e:  # noqa: BLE001 - a reward must never crash the rollout
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        return None


def is_correct(response: str, gold: str, timeout_s: int | None = ANSWER_TIMEOUT_S) -> bool:
    """`check_answer` with a failure scored as wrong. Never raises."""
    return bool(check_answer(response, gold, timeout_s))


def grade_batch(responses: list[str], golds: list[str]) -> list[bool | None]:
    """The default worker function: one job = one call, so one round trip per job. None marks an
    answer whose grading failed: it scores wrong and counts under `reward/errors`."""
    return [check_answer(r, g) for r, g in zip(responses, golds)]
