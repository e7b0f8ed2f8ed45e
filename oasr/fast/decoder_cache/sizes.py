"""The fast decoder cache's dispatch by size: below these sizes Python scalars beat numpy.

A beam (at most ``FEW_ROWS`` rows) takes element-wise paths with the same
results: its select (``_select_few``: rows by plain indexing, the dropped and
forked references in one ``pool._free_and_share``), its step's decision
(``_prepare_few``), the select's bound and the handle's commit. On a few rows
numpy's per-call cost, not the work, is what a numpy path pays; the tests run
both paths against the oracle.

The parts read these as ``sizes.FEW_ROWS`` / ``sizes.FEW_CANCEL`` when called,
so that a test setting one here (``monkeypatch.setattr(sizes, ...)``) moves every
path it governs.
"""

FEW_ROWS = 8  # _prepare: up to this many rows (a beam), Python scalars beat the numpy calls' setup
FEW_CANCEL = 192  # _cancel: up to this many ids in all, the counting loop beats the numpy ops' setup
