"""The model package sits below `checkpoint/` (docs/ARCHITECTURE.md's map): it never imports it, not even lazily
inside a function; saving is `flashnext.save_pretrained(model, dir)`, a function of `checkpoint/`."""

from __future__ import annotations

import ast
from pathlib import Path

import flashnext.model


def _imported_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):  # every import, at the top or inside a function
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_model_package_never_imports_checkpoint():
    files = sorted(Path(flashnext.model.__file__).parent.rglob("*.py"))
    offenders = {p.name: sorted(m for m in _imported_modules(p) if m.split(".")[:2] == ["flashnext", "checkpoint"])
                 for p in files}  # fmt: skip
    assert {k: v for k, v in offenders.items() if v} == {}


def test_save_pretrained_is_a_package_function_not_a_model_method():
    from flashnext.checkpoint import save_pretrained
    from flashnext.model.multimodal import FlashNextForConditionalGeneration
    from flashnext.model.text import FlashNextForCausalLM

    assert flashnext.save_pretrained is save_pretrained
    assert not hasattr(FlashNextForCausalLM, "save_pretrained")
    assert not hasattr(FlashNextForConditionalGeneration, "save_pretrained")
