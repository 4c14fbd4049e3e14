"""The tool-call text protocol of multi-turn rollouts (ReTool style), as pure string functions.

The model writes a program between code tags and stops; the rollout runs it and appends the
output between interpreter tags; generation resumes after them:

    ... so let me compute it.
    <code>
    ```python
    print(sum(range(1, 101)))
    ```
    </code>
    <interpreter>
    5050
    </interpreter>
    The sum is 5050. ...

Generation stops at `CODE_STOP` (a vLLM stop string, kept in the output), `extract_code` takes the
program of the block the response ends with, and `format_output` builds the interpreter text
(truncated to `max_chars`), whose tokens are context, not actions (masked out of the loss).
"""
from __future__ import annotations

CODE_START = "<code>"
CODE_STOP = "</code>"
OUTPUT_START = "\n<interpreter>\n"
OUTPUT_END = "\n</interpreter>\n"


def extract_code(text: str) -> str | None:
    """The program of the code block that ``text`` ends with (after a stop at `CODE_STOP`), fences
    stripped; None if the text does not end with a complete, non-empty code block."""
    body = text.rstrip()
    if not body.endswith(CODE_STOP):
        return None
    start = body.rfind(CODE_START, 0, len(body) - len(CODE_STOP))
    if start < 0:
        return None
    code = body[start + len(CODE_START) : len(body) - len(CODE_STOP)].strip("\n")
    lines = code.strip().splitlines()
    if lines and lines[0].strip().startswith("```"):
        lines = lines[1:]
    if lines and lines[-1].strip() == "```":
        lines = lines[:-1]
    code = "\n".join(lines).strip("\n")
    return code if code.strip() else None


def truncate(text: str, max_chars: int) -> str:
    """At most ``max_chars`` characters: the head and the tail, with the cut said in between."""
    if len(text) <= max_chars:
        return text
    marker = f"\n... [{len(text) - max_chars} characters cut] ...\n"
    keep = max(0, max_chars - len(marker))
    head = keep - keep // 3
    return text[:head] + marker + text[len(text) - keep // 3 :] if keep // 3 else text[:keep] + marker


def format_output(output: str, max_chars: int) -> str:
    """The interpreter block appended after a code block (tool output, truncated)."""
    return OUTPUT_START + truncate(output.rstrip("\n"), max_chars) + OUTPUT_END
