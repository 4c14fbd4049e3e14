"""pace/tools/protocol.py: finding the program a response stops on, and the interpreter text."""
from __future__ import annotations

import pytest

from pace.tools.protocol import CODE_STOP, OUTPUT_END, OUTPUT_START, extract_code, format_output, truncate

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("text, code", [
    ("Let me compute.\n<code>\n```python\nprint(1 + 1)\n```\n</code>", "print(1 + 1)"),
    ("<code>```python\nx = 3\nprint(x * x)\n```</code>\n", "x = 3\nprint(x * x)"),
    ("<code>\nprint(7)\n</code>", "print(7)"),  # no fences
    ("<code>a = 1</code> then <code>\n```python\nprint(2)\n```\n</code>", "print(2)"),  # the last block
    ("  indented:\n<code>\n```python\nfor i in range(2):\n    print(i)\n```\n</code>", "for i in range(2):\n    print(i)"),
])
def test_extract_code_takes_the_block_the_response_ends_with(text, code):
    assert extract_code(text) == code


@pytest.mark.parametrize("text", [
    "Answer: 42",  # no tool call: the response is finished
    "<code>\n```python\nprint(1)\n```\n",  # cut by the length limit inside the block
    "print(1)\n</code>",  # no opening tag
    "<code>\n```python\n```\n</code>",  # empty program
    "<code>\n   \n</code>",
    "<code>\nprint(1)\n</code> and then more text",  # a block, but the response went on
])
def test_extract_code_finds_nothing_to_run(text):
    assert extract_code(text) is None


def test_output_is_wrapped_and_truncated_to_the_budget():
    block = format_output("5050\n", 100)
    assert block == OUTPUT_START + "5050" + OUTPUT_END
    long = "".join(f"line {i}\n" for i in range(1000))
    cut = truncate(long, 300)
    assert len(cut) <= 300 and cut.startswith("line 0\n") and cut.endswith("line 999\n") and "characters cut" in cut
    assert truncate("short", 300) == "short"
    assert CODE_STOP == "</code>"
