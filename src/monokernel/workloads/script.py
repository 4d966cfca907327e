"""The canned coding-agent session: a task, then tool outputs the agent "reads" each turn.

The texts are what a real agent loop feeds back (a file listing, a test file, pytest
failures, a lint report): a few hundred tokens each, so every turn grows the context the
way an agent's does. Turns past the end repeat the test-log → fix part.
"""

from __future__ import annotations

from dataclasses import dataclass

SYSTEM_PROMPT = (
    "You are a coding agent working in a Python repository. Each turn you get the output of "
    "the last tool you ran. Think briefly, then either write a unified diff or say which "
    "command to run next. Keep answers focused on the failing behaviour."
)
TASK = (
    "Bug report: textkit.wrap.wrap_text() drops the last word when a line is exactly "
    "`width` characters long, and it loops forever when width < 1. Fix both, keep the "
    "public signature, and make `pytest tests/test_wrap.py` and `ruff check` pass."
)


@dataclass(frozen=True, slots=True)
class Step:
    phase: str  # what the agent is asked to do after reading the tool output
    command: str  # the tool call whose output is shown
    output: str
    instruction: str


_SOURCE = '''\
$ sed -n 1,60p src/textkit/wrap.py
"""Greedy word wrapping for terminal output."""

from __future__ import annotations

from collections.abc import Iterable


def _words(text: str) -> Iterable[str]:
    for chunk in text.split():
        yield chunk


def wrap_text(text: str, width: int = 80, indent: str = "") -> list[str]:
    """Wrap ``text`` into lines of at most ``width`` characters."""
    lines: list[str] = []
    line = indent
    for word in _words(text):
        while len(word) > width - len(indent):
            lines.append(indent + word[: width - len(indent)])
            word = word[width - len(indent) :]
        if len(line) + len(word) + 1 < width:
            line = f"{line} {word}" if line.strip() else indent + word
        else:
            lines.append(line)
            line = indent + word
    if line.strip() and len(line) < width:
        lines.append(line)
    return lines


def fill(text: str, width: int = 80) -> str:
    return "\\n".join(wrap_text(text, width))
'''

_TESTS = """\
$ sed -n 1,48p tests/test_wrap.py
import pytest

from textkit.wrap import fill, wrap_text


def test_short_text_is_one_line():
    assert wrap_text("hello world", width=20) == ["hello world"]


def test_exact_width_keeps_last_word():
    assert wrap_text("aaaa bbbb", width=9) == ["aaaa bbbb"]
    assert wrap_text("aaaa bbbb cc", width=9) == ["aaaa bbbb", "cc"]


def test_long_word_is_split():
    assert wrap_text("abcdefghij", width=4) == ["abcd", "efgh", "ij"]


def test_indent_counts_towards_width():
    assert wrap_text("one two three", width=8, indent="  ") == ["  one", "  two", "  three"]


@pytest.mark.parametrize("width", [0, -3])
def test_bad_width_raises(width):
    with pytest.raises(ValueError, match="width"):
        wrap_text("anything", width=width)


def test_fill_joins_lines():
    assert fill("a b c d", width=3) == "a b\\nc d"
"""

_FAIL_1 = """\
$ python -m pytest -x -q tests/test_wrap.py
..F
=================================== FAILURES ===================================
________________________ test_exact_width_keeps_last_word ________________________

    def test_exact_width_keeps_last_word():
>       assert wrap_text("aaaa bbbb", width=9) == ["aaaa bbbb"]
E       AssertionError: assert ['aaaa'] == ['aaaa bbbb']
E         At index 0 diff: 'aaaa' != 'aaaa bbbb'
E         Full diff:
E         - ['aaaa bbbb']
E         + ['aaaa']

tests/test_wrap.py:11: AssertionError
=========================== short test summary info ============================
FAILED tests/test_wrap.py::test_exact_width_keeps_last_word - AssertionError: ass...
!!!!!!!!!!!!!!!!!!!!!!!!!! stopping after 1 failures !!!!!!!!!!!!!!!!!!!!!!!!!!!
1 failed, 2 passed in 0.04s
"""

_FAIL_2 = """\
$ python -m pytest -q tests/test_wrap.py
....F.F
=================================== FAILURES ===================================
__________________________ test_bad_width_raises[0] ___________________________

width = 0

    @pytest.mark.parametrize("width", [0, -3])
    def test_bad_width_raises(width):
        with pytest.raises(ValueError, match="width"):
>           wrap_text("anything", width=width)

tests/test_wrap.py:26:
_ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _

    def wrap_text(text: str, width: int = 80, indent: str = "") -> list[str]:
        lines: list[str] = []
        line = indent
        for word in _words(text):
            while len(word) > width - len(indent):
>               lines.append(indent + word[: width - len(indent)])
E               Failed: Timeout >5.0s

src/textkit/wrap.py:18: Failed
__________________________ test_fill_joins_lines ______________________________

    def test_fill_joins_lines():
>       assert fill("a b c d", width=3) == "a b\\nc d"
E       AssertionError: assert 'a b\\nc d\\n' == 'a b\\nc d'

tests/test_wrap.py:31: AssertionError
=========================== short test summary info ============================
FAILED tests/test_wrap.py::test_bad_width_raises[0] - Failed: Timeout >5.0s
FAILED tests/test_wrap.py::test_fill_joins_lines - AssertionError: assert 'a b...
2 failed, 5 passed in 5.21s
"""

_LINT = """\
$ python -m pytest -q tests/test_wrap.py && ruff check src tests
.......                                                                  [100%]
7 passed in 0.03s
src/textkit/wrap.py:8:1: UP028 Replace `yield` over `for` loop with `yield from`
   |
 8 | def _words(text: str) -> Iterable[str]:
 9 |     for chunk in text.split():
10 |         yield chunk
   |     ^^^^^^^^^^^^^^^^^^^^^^^^^^^ UP028
   |
   = help: Replace with `yield from`
src/textkit/wrap.py:15:89: E501 Line too long (93 > 88)
   |
15 |         raise ValueError(f"width must exceed len(indent)={len(indent)}, got {width}")
   |                                                                    ^^^^^ E501
   |
Found 2 errors.
[*] 1 fixable with the `--fix` option.
"""

_GREEN = """\
$ python -m pytest -q && ruff check src tests && git diff --stat
........................................................................ [ 61%]
.............................................                            [100%]
117 passed, 2 skipped in 1.84s
All checks passed!
 src/textkit/wrap.py | 17 +++++++++--------
 tests/test_wrap.py  |  4 ++++
 2 files changed, 13 insertions(+), 8 deletions(-)
"""

STEPS: tuple[Step, ...] = (
    Step("plan", "read_file", _SOURCE, "Plan the fix in a few steps."),
    Step("patch", "read_file", _TESTS, "Write the patch as a unified diff."),
    Step("fix", "run_tests", _FAIL_1, "Explain the failure and write a corrected diff."),
    Step("fix", "run_tests", _FAIL_2, "Fix the remaining failures with a diff."),
    Step("fix", "run_lint", _LINT, "Fix the lint errors with a diff."),
    Step("summarise", "run_tests", _GREEN, "Summarise the change for the pull request."),
)
REPEAT_FROM = 2  # turns past the script repeat the test-log → fix steps


def step_for_turn(turn: int) -> Step:
    if turn < len(STEPS):
        return STEPS[turn]
    cycle = STEPS[REPEAT_FROM:]
    return cycle[(turn - REPEAT_FROM) % len(cycle)]


def tool_message(step: Step) -> str:
    return f"[tool {step.command}]\n{step.output}\n{step.instruction}"
