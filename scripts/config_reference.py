"""docs/config-reference.md from the typed schema (pace/config.py): every group and key, its type,
default and the schema's own comment on it. The test suite checks the committed page is what this
writes, so the reference cannot drift from the code.

    python scripts/config_reference.py            # rewrite docs/config-reference.md
    python scripts/config_reference.py --check    # exit 1 if it is out of date
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PAGE = ROOT / "docs" / "config-reference.md"
SOURCES = [ROOT / "pace" / "config.py", ROOT / "pace" / "tiny_spec.py", ROOT / "pace" / "tasks" / "arithmetic.py",
           ROOT / "pace" / "tasks" / "tool_arithmetic.py"]


def comments() -> dict[tuple[str, str], str]:
    """(class, field) → the comment on the field's line, or on the lines just above it."""
    out = {}
    for path in SOURCES:
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, ast.ClassDef):
                continue
            for stmt in node.body:
                if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
                    continue
                i = stmt.lineno - 1
                text = lines[i].split("  # ", 1)[1].strip() if "  # " in lines[i] else ""
                above, j = [], i - 1
                while j >= 0 and lines[j].strip().startswith("#"):
                    above.insert(0, lines[j].strip().lstrip("#").strip())
                    j -= 1
                out[node.name, stmt.target.id] = " ".join([*above, text]).strip()
    return out


def _type(tp) -> str:
    name = getattr(tp, "__name__", None) or str(tp)
    return str(tp).replace("typing.", "") if name in ("Optional", "Dict", "List") or "typing" in str(tp) else name


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        v = f.default
    elif f.default_factory is not dataclasses.MISSING:
        v = f.default_factory()
        if dataclasses.is_dataclass(v):
            return "(group)"
    else:
        return "(required)"
    return "null" if v is None else repr(v).replace("'", "") if not isinstance(v, bool) else str(v).lower()


def rows(cls, prefix: str, notes: dict) -> list[str]:
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            out += rows(tp, key + ".", notes)
            continue
        note = notes.get((cls.__name__, f.name), "").replace("|", "\\|")
        out.append(f"| `{key}` | {_type(tp).replace('|', chr(92) + '|')} | `{_default(f)}` | {note} |")
    return out


def render() -> str:
    from pace.config import Config

    notes = comments()
    lines = ["# Configuration reference", "",
             "Every key of the typed schema (`pace/config.py`), its type, default and the schema's comment. Generated "
             "by `python scripts/config_reference.py`; the test suite fails when this page and the schema differ. "
             "Presets (`conf/exp/*.yaml`) and groups (`conf/<group>/*.yaml`) override these defaults; "
             "[configuration](configuration.md) says how.", ""]
    hints = typing.get_type_hints(Config)
    top = [f for f in dataclasses.fields(Config) if not dataclasses.is_dataclass(hints[f.name])]
    lines += ["## top level", "", "| key | type | default | what |", "| --- | --- | --- | --- |"]
    for f in top:
        note = notes.get(("Config", f.name), "").replace("|", "\\|")
        lines.append(f"| `{f.name}` | {_type(hints[f.name])} | `{_default(f)}` | {note} |")
    for f in dataclasses.fields(Config):
        tp = hints[f.name]
        if not dataclasses.is_dataclass(tp):
            continue
        doc = (tp.__doc__ or "").strip().splitlines()[0] if tp.__doc__ and not tp.__doc__.startswith(tp.__name__ + "(") else ""
        lines += ["", f"## {f.name}", ""] + ([doc, ""] if doc else []) + ["| key | type | default | what |", "| --- | --- | --- | --- |"]
        lines += rows(tp, f.name + ".", notes)
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page is out of date")
    args = ap.parse_args()
    text = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            sys.exit(f"{PAGE.relative_to(ROOT)} is out of date: python scripts/config_reference.py")
        return
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)} ({text.count(chr(10))} lines)")


if __name__ == "__main__":
    main()
