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
