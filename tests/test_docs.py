"""The code examples in docs/*.md run: every ```python block of a page, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def python_blocks(page: Path) -> list[str]:
    return FENCE.findall(page.read_text())


@pytest.mark.parametrize("page", ["cache_manager.md", "layer_specs.md"])
def test_page_examples_run(page):
    blocks = python_blocks(DOCS / page)
    assert blocks, f"docs/{page} has no python example"
    namespace: dict = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/{page} [python block {i}]", "exec"), namespace)


def test_cache_manager_example_covers_the_lifecycle_on_both_twins():
    (code,) = python_blocks(DOCS / "cache_manager.md")
    for call in ("allocate_stream", "prepare_chunks_batched", "get_paged_caches", "append_kv", "paged_attention",
                 "commit_chunks_batched", "free_stream"):  # fmt: skip
        assert f".{call}(" in code, call
    assert "for twin in (oasr.reference, oasr.fast)" in code


ROOT = DOCS.parent
# References that only the project's history explains: issue numbers, design-seed sections.
HISTORY = re.compile(r"\b[Ii]ssues? #?\d+|\b[Ss]eeds? 0\d\d\b|\u00a7 ?\d")
PENDING: set = set()  # (file, snippet) pairs allowed through while being rewritten; none now


def _texts():
    for pattern in ("README.md", "docs/*.md", "oasr/**/*.py", "oasr/kernels_cu/**/*", "notebooks/*.py",
                    "tests/**/*.py", "tools/*"):
        for path in sorted(ROOT.glob(pattern)):
            if path.is_file() and path.name != "test_docs.py":
                yield path.relative_to(ROOT).as_posix(), path.read_text()


def test_docs_and_code_explain_instead_of_citing_history():
    found = [f"{name}:{n}: {line.strip()}" for name, text in _texts()
             for n, line in enumerate(text.splitlines(), 1)
             if HISTORY.search(line) and not any(name == p and snippet in line for p, snippet in PENDING)]
    assert not found, "\n".join(found)


def test_notebooks_say_both_twins_run():
    stale = [name for name, text in _texts() if name.startswith("notebooks/") and "once the fast twin" in text]
    assert not stale, stale


def test_every_public_function_and_method_has_a_docstring():
    """What ``help()`` shows a user: every public function, and every public method of a public class, says
    what it does (names starting with ``_`` are internal and exempt)."""
    import ast

    missing = []
    for path in sorted((ROOT / "oasr").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            items = [(node.name, node)] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else []
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                items = [(f"{node.name}.{f.name}", f) for f in node.body
                         if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
            missing += [f"{path.relative_to(ROOT)}:{f.lineno} {name}" for name, f in items
                        if not name.split(".")[-1].startswith("_") and ast.get_docstring(f) is None]
    assert not missing, f"{len(missing)} without a docstring:\n" + "\n".join(missing)
