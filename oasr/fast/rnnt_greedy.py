"""Fast RNN-T greedy decoding: a chunk's frames for the whole cohort with no host sync per frame.

Same contract and results as ``oasr.reference.rnnt_greedy`` (the oracle). Every stream takes the same
fixed number of iterations, ``T * max_symbols_per_step`` (the most a chunk of ``T`` frames can need:
each iteration either emits or moves a frame, and a frame holds at most ``max_symbols`` emissions), as
batched tensor ops with masked updates::

    g, h', c' = predict(last, h, c)               one LSTM step for every stream
    k         = argmax joint(e[b, t_b], g)        t_b clamped: finished streams compute and discard
    emit      = active & (k != blank)
    h, c, last = where(emit, (h', c', k+1), (h, c, last))
    n         = where(emit, n + 1, 0)
    advance   = active & (!emit | n == max_symbols);  t += advance;  n = where(advance, 0, n)

No ``.item()``, no data-dependent shape or branch: the loop is capture-safe (:class:`RnntGreedyGraphs`
records one CUDA graph per cohort width and chunk length and replays it). Emissions land in a fixed
``(B, T * max_symbols)`` buffer (``-1`` where an iteration emitted nothing), read back once per chunk.
On the CPU (eager, where a host read is free) the loop stops early once every stream is past its frames.
"""

from __future__ import annotations

import torch

from oasr.reference.rnnt_greedy import check_inputs


def _loop(head, e: torch.Tensor, lengths: torch.Tensor, h, c, last, max_symbols: int, early_exit: bool = False):
    """The fixed-count masked loop over projected frames ``e`` ``(B, T, H)``; writes ``h``/``c``/``last`` in place
    and returns ``(tokens, frames)`` ``(B, T * max_symbols)`` int64, ``-1`` where nothing was emitted.

    ``early_exit`` (the CPU's eager path, where reading a value costs no device round trip): stop once every
    stream has passed its last frame instead of running all ``T * max_symbols`` iterations (a mostly-blank
    chunk needs about ``T``). The remaining iterations would change nothing, so the results are the same."""
    batch, frames = e.shape[0], e.shape[1]
    rows = torch.arange(batch, device=e.device)
    t = torch.zeros(batch, dtype=torch.int64, device=e.device)
    n = torch.zeros_like(t)
    blank = head.spec.blank_id
    steps = frames * max_symbols
    out_tok = torch.full((batch, steps), -1, dtype=torch.int64, device=e.device)
    out_frame = torch.full_like(out_tok, -1)
    for i in range(steps):
        active = t < lengths
        if early_exit and not bool(active.any()):
            break
        g, h2, c2 = head.predict(last, h, c)
        k = head.joint(e[rows, t.clamp(max=frames - 1)], g).argmax(dim=-1)
        emit = active & (k != blank)
        h.copy_(torch.where(emit[None, :, None], h2, h))
        c.copy_(torch.where(emit[None, :, None], c2, c))
        last.copy_(torch.where(emit, k + 1, last))
        out_tok[:, i] = torch.where(emit, k, -1)
        out_frame[:, i] = torch.where(emit, t, -1)
        n = torch.where(emit, n + 1, torch.zeros_like(n))
        advance = active & (~emit | (n >= max_symbols))
        t = t + advance.long()
        n = torch.where(advance, torch.zeros_like(n), n)
    return out_tok, out_frame


def _unpack(out_tok: torch.Tensor, out_frame: torch.Tensor):
    tok, fr = out_tok.cpu(), out_frame.cpu()  # the chunk's one host read
    tokens, frames = [], []
    for b in range(tok.shape[0]):
        keep = tok[b] >= 0
        tokens.append(tok[b][keep].tolist())
        frames.append(fr[b][keep].tolist())
    return tokens, frames


@torch.no_grad()
def decode_chunk(head, enc: torch.Tensor, state: dict, num_frames=None, max_symbols=None):
    """See ``oasr.reference.rnnt_greedy.decode_chunk`` (same contract; ``state`` is not modified)."""
    num_frames, max_symbols = check_inputs(head, enc, state, num_frames, max_symbols)
    new = {k: v.clone() for k, v in state.items()}
    lengths = torch.tensor(num_frames, dtype=torch.int64, device=enc.device)
    out = _loop(head, head.project_encoder(enc), lengths, new["rnnt_h"], new["rnnt_c"], new["rnnt_last"][:, 0],
                max_symbols, early_exit=enc.device.type == "cpu")
    return (*_unpack(*out), new)


def graph_width(batch: int) -> int:
    """The graph width a cohort of ``batch`` streams runs at: the next power of two (at most twice the rows, and
    one graph per doubling instead of one per cohort size a live server meets)."""
    if batch < 1:
        raise ValueError(f"graph_width: a cohort has >= 1 stream, got {batch}")
    return 1 << (batch - 1).bit_length()


def pad_cohort(enc: torch.Tensor, state: dict, num_frames: list, width: int):
    """``enc``, ``state`` and ``num_frames`` of ``B`` streams padded to ``width`` rows: zero frames, zero state and
    0 frames to decode, so a padding row never emits and its state never changes (the real rows' results are
    those of the unpadded call). ``ValueError`` for ``width < B``."""
    batch = enc.shape[0]
    if width < batch:
        raise ValueError(f"pad_cohort: width {width} < the cohort's {batch} streams")
    extra = width - batch
    if not extra:
        return enc, state, list(num_frames)
    enc = torch.cat([enc, enc.new_zeros(extra, *enc.shape[1:])])
    padded = {}
    for name, value in state.items():
        axis = 1 if name in ("rnnt_h", "rnnt_c") else 0  # (layers, B, H) and (B, 1)
        shape = list(value.shape)
        shape[axis] = extra
        padded[name] = torch.cat([value, value.new_zeros(shape)], dim=axis)
    return enc, padded, list(num_frames) + [0] * extra


class RnntGreedyGraphs:
    """CUDA graphs of the decode loop, one per (graph width, chunk frames); eager off the GPU.

    ``run(enc, state, num_frames)`` equals :func:`decode_chunk`; on a CUDA device a cohort is padded to its
    :func:`graph_width` (:func:`pad_cohort`), the first call of a shape captures the loop on static buffers and
    later calls copy inputs in, replay and copy the state out (the padding rows dropped).
    """

    def __init__(self, head, max_symbols: int | None = None):
        self.head = head
        self.max_symbols = head.spec.max_symbols_per_step if max_symbols is None else int(max_symbols)
        self._graphs: dict = {}

    @torch.no_grad()
    def run(self, enc: torch.Tensor, state: dict, num_frames=None):
        """``decode_chunk(head, enc, state, num_frames)`` through the shape's graph (eager off the GPU)."""
        num_frames, max_symbols = check_inputs(self.head, enc, state, num_frames, self.max_symbols)
        if enc.device.type != "cuda":
            return decode_chunk(self.head, enc, state, num_frames, max_symbols)
        batch = enc.shape[0]
        enc, state, num_frames = pad_cohort(enc, state, num_frames, graph_width(batch))
        key = (enc.shape[0], enc.shape[1], enc.dtype)
        if key not in self._graphs:
            self._graphs[key] = self._capture(enc, state, max_symbols)
        graph, io = self._graphs[key]
        io["enc"].copy_(enc)
        io["lengths"].copy_(torch.tensor(num_frames, dtype=torch.int64))
        for name in ("rnnt_h", "rnnt_c", "rnnt_last"):
            io[name].copy_(state[name])
        graph.replay()
        new = {"rnnt_h": io["rnnt_h"][:, :batch].clone(), "rnnt_c": io["rnnt_c"][:, :batch].clone(),
               "rnnt_last": io["rnnt_last"][:batch].clone()}
        return (*_unpack(io["tok"][:batch], io["frame"][:batch]), new)

    def _capture(self, enc, state, max_symbols):
        io = {"enc": enc.clone(), "lengths": torch.zeros(enc.shape[0], dtype=torch.int64, device=enc.device)}
        for name in ("rnnt_h", "rnnt_c", "rnnt_last"):
            io[name] = state[name].clone()
        saved = {k: io[k].clone() for k in ("rnnt_h", "rnnt_c", "rnnt_last")}

        def body():
            return _loop(self.head, self.head.project_encoder(io["enc"]), io["lengths"], io["rnnt_h"],
                         io["rnnt_c"], io["rnnt_last"][:, 0], max_symbols)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            body()  # warm-up on a side stream, as capture requires
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            io["tok"], io["frame"] = body()
        for k, v in saved.items():
            io[k].copy_(v)
        return graph, io
