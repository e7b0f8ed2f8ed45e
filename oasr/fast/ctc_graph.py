"""The fast CTC prefix beam search of a whole chunk as one replayed CUDA graph.

``StreamingCtcDecoder(device="cuda", cuda_graphs=True)`` decodes a cohort's chunk through
``ChunkSearchGraphs``: the chunk's ``T`` frames (``search_chunk`` in ``oasr.fast.ctc_decoder``:
candidates, ``T`` x ``_advance``, dead slots cleared, the header) are captured once per
(width bucket, ``T``, vocab, dtype) by a ``GraphRunner`` (its capture, preflight and abort),
and replayed; the host does per call::

    copy in     the cohort's beams (one ``cat`` per field), the chunk, and each row's first frame
                and length (one non-blocking upload from a pinned buffer) into the static inputs
    replay      the graph: every frame, no host work
    one read    the header (bad input, prefix overflow, each row's longest prefix)
    copy out    the new beams into each state (one multi-tensor copy per field), only if the header
                says the call succeeded: a failed call leaves every state unchanged

Shapes are fixed per graph: the rows are padded to the width bucket (a power of two, capped at
``max_width``: an engine's ``max_batch_size``, whose widths it captures up front with ``prepare``) with
rows of length 0, the frames to the graph's ``T`` with zeros (a row past its length keeps its
beams, so padding changes nothing), and the token window is the whole ``max_prefix_len`` (the
eager path's narrower window only trims positions that hold padding). A call with ``T`` frames
replays the captured graph of the smallest ``T' >= T`` at its width, or captures ``(width, T)``.
Results equal the eager batched search (and so the reference): tests/test_ctc_graph.py.
"""

from __future__ import annotations

import logging

import torch

from oasr.ctc.config import values_error
from oasr.fast.graph_runner import CudaGraphCapture, GraphRunner

_logger = logging.getLogger("oasr.fast")


def width_bucket(rows: int) -> int:
    """The graph width for ``rows`` rows: the next power of two."""
    return 1 << max(rows - 1, 0).bit_length()


class _ChunkGraph:
    """Static inputs of one (width, T, vocab, dtype) and the runner that replays the search over them."""

    def __init__(self, decoder, width: int, frames: int, vocab: int, dtype: torch.dtype, capture):
        from oasr.fast.ctc_search import _allocate, _fill_initial, search_chunk

        device = decoder.device
        self.width, self.frames = width, frames
        self.beams = _allocate(width, decoder.config, device)
        _fill_initial(self.beams)  # padding rows hold a valid (empty) beam
        self.lp = torch.zeros(width, frames, vocab, dtype=dtype, device=device)
        self.ints = torch.zeros(2, width, dtype=torch.int64, device=device)  # first frame, row length
        self.host = torch.zeros(2, width, dtype=torch.int64, pin_memory=device.type == "cuda")
        config, candidates = decoder.config, decoder._candidates

        def step(w: int):
            beams, header = search_chunk(self.beams, self.lp, self.ints[0], self.ints[1], config, candidates)
            return [*beams, header]

        self.runner = GraphRunner(step, [width], capture)
        self.runner.capture_all()


def _rows_of(state):
    """The state's rows in use: its buffers themselves when it uses them all (no views to make)."""
    return state.buffers if state.batch == state.capacity else state.rows()


class ChunkSearchGraphs:
    """Graph-replayed chunk search for one ``StreamingCtcDecoder`` (module docstring).

    ``capture`` is a zero-argument factory of the capture strategy (default: ``CudaGraphCapture``
    on the decoder's device); each graph gets its own, so one failed capture discards only its graph.
    """

    def __init__(self, decoder, capture=None):
        self.decoder = decoder
        self._capture = capture if capture is not None else (lambda: CudaGraphCapture(decoder.device))
        self._graphs: dict[tuple, _ChunkGraph] = {}
        self.replays = 0
        self.max_width: int | None = None  # widths cap here (an engine's max_batch_size): no bucket past it

    def prepare(self, widths, frames: int, vocab: int, dtype: torch.dtype = torch.float32) -> None:
        """Capture the graphs of ``widths`` x ``frames`` now (an engine does this at construction, so no
        capture lands in a served tick); a width already captured for at least ``frames`` is skipped."""
        for width in sorted(set(widths), reverse=True):
            self._graph(width, frames, vocab, dtype)

    def _width(self, rows: int) -> int:
        width = width_bucket(rows)
        if self.max_width is not None and rows <= self.max_width:
            width = min(width, self.max_width)
        return width

    @property
    def keys(self) -> list[tuple]:
        """The captured ``(width, T, vocab, dtype)`` keys."""
        return sorted(self._graphs, key=str)

    def _graph(self, rows: int, frames: int, vocab: int, dtype) -> _ChunkGraph:
        width = self._width(rows)
        fits = [k for k in self._graphs if k[0] == width and k[2] == vocab and k[3] == dtype and k[1] >= frames]
        if fits:
            return self._graphs[min(fits, key=lambda k: k[1])]
        graph = _ChunkGraph(self.decoder, width, frames, vocab, dtype, self._capture())
        self._graphs[(width, frames, vocab, dtype)] = graph
        _logger.info("oasr.fast: CTC chunk search: captured a CUDA graph for %d rows x %d frames (vocab %d)",
                     width, frames, vocab)
        return graph

    def decode(self, states: list, lp: torch.Tensor, row_lengths: list[int], where: str) -> None:
        """The chunk ``lp`` (R, T, V) of ``states`` (their rows stacked): replay, one read, then commit."""
        R, T, V = lp.shape
        g = self._graph(R, T, V, lp.dtype)
        if T == g.frames:
            g.lp[:R].copy_(lp)
        else:
            g.lp[:R, T:].zero_()
            g.lp[:R, :T].copy_(lp)
        if R < g.width:
            g.lp[R:].zero_()
        rows = [_rows_of(s) for s in states]
        for i, buf in enumerate(g.beams):
            parts = [r[i] for r in rows]
            if len(parts) == 1:
                buf[:R].copy_(parts[0])
            else:
                torch.cat(parts, 0, out=buf[:R])
        g.host[0, :R] = torch.tensor([s.frames_decoded for s in states for _ in range(s.batch)], dtype=torch.int64)
        g.host[1, :R] = torch.tensor(row_lengths, dtype=torch.int64)
        g.host[1, R:] = 0  # padding rows: no frames, they keep their beams
        g.ints.copy_(g.host, non_blocking=True)
        outputs = g.runner.run(g.width)
        self.replays += 1
        header = outputs[-1][: 2 + R].tolist()  # the one host read
        if header[0]:
            raise values_error(where)
        if header[1]:
            raise self.decoder._prefix_len_error()
        sizes = [s.batch for s in states]
        for i in range(len(g.beams)):
            torch._foreach_copy_([r[i] for r in rows], list(outputs[i][:R].split(sizes)))
        start = 0
        for state in states:
            state.longest = max(header[2 + start : 2 + start + state.batch])
            start += state.batch
