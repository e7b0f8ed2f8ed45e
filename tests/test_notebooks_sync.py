"""Every notebook's jupytext source (notebooks/NN_name.py) and its .ipynb pair hold the same cells.

The .py is the source; the .ipynb is what nbval runs. A .py edited without
``jupytext --sync notebooks/NN_name.py`` would leave CI testing stale cells, so
this test fails until the pair is synced. The committed .ipynb carries no outputs.
"""

from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
SOURCES = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))


def cells(notebook) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source) for cell in notebook.cells]


def test_there_are_notebooks():
    assert len(SOURCES) >= 6


def test_every_ipynb_has_a_source():
    orphans = [p.name for p in NOTEBOOKS.glob("*.ipynb") if not p.with_suffix(".py").exists()]
    assert not orphans, f"notebooks without a jupytext .py source: {orphans}"


def test_pairing_is_configured():
    config = (NOTEBOOKS / "jupytext.toml").read_text()
    assert 'formats = "ipynb,py:percent"' in config


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_pair_in_sync(source):
    paired = source.with_suffix(".ipynb")
    assert paired.exists(), f"{paired.name} missing: run `jupytext --sync notebooks/{source.name}`"
    from_py, from_ipynb = jupytext.read(source), jupytext.read(paired)
    assert cells(from_py) == cells(from_ipynb), (
        f"{source.name} and {paired.name} differ: run `jupytext --sync notebooks/{source.name}`"
    )
    assert from_py.metadata.get("kernelspec") == from_ipynb.metadata.get("kernelspec")


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_committed_ipynb_has_no_outputs(source):
    notebook = jupytext.read(source.with_suffix(".ipynb"))
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code
    assert all(not cell.outputs and cell.execution_count is None for cell in code)
