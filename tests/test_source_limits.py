"""The size limits the contributor map promises (docs/ARCHITECTURE.md, issue 23): in `src/`, no file over 500 lines,
no class over 250, no function over 60 unless its docstring says why it is long (it names its length: "... lines")."""

from __future__ import annotations

import ast
from pathlib import Path

import flashnext

SRC = Path(flashnext.__file__).parent
FILE_LINES, CLASS_LINES, FUNCTION_LINES = 500, 250, 60


def _oversized() -> list[str]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(SRC.parent)
        if text.count("\n") > FILE_LINES:
            out.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and lines > CLASS_LINES:
                out.append(f"{name}: class {node.name} {lines} lines")
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and lines > FUNCTION_LINES:
                if "lines" not in (ast.get_docstring(node) or ""):
                    out.append(f"{name}: {node.name}() {lines} lines, no reason in its docstring")
    return out


def test_no_file_class_or_function_over_the_limits():
    assert _oversized() == []
