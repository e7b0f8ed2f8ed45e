"""Fast streaming CTC prefix beam search: every frame is a handful of batched tensor ops.

It must agree with ``oasr.reference.ctc_decoder`` (the oracle): same n-best
token sequences and emission frames, scores within 1e-5, same errors. The
search rule, tie-break order and emission-frame rule live in
``oasr.ctc.config``; the batched search below implements them without a
Python loop over streams, rows or beams (the only loop is over the frames of
a chunk). Tiny CPU cohorts take a host loop instead (see "Two paths").

State layout (``CtcBeamState``; ``R`` rows, ``W = beam_size``, ``L = max_prefix_len``)::

    tokens       (R, W, L) int32    prefix tokens, -1 past ``lengths`` (the padding invariant)
    frames       (R, W, L) int32    emission frame of each token, -1 past ``lengths``
    lengths      (R, W)    int64    tokens in the prefix
    keys         (R, W)    int64    rolling hash of the prefix (see below)
    parent_keys  (R, W)    int64    hash of the prefix minus its last token; -1 for the empty prefix
    last         (R, W)    int64    last token, -1 for the empty prefix
    log_pb       (R, W)    float64  blank-ending log score
    log_pnb      (R, W)    float64  non-blank-ending log score

Committed prefix: when a call would outgrow ``L``, the tokens every prefix of a row shares move
out of these buffers into ``CtcBeamState.committed`` (host lists) and the call runs in pieces
that fit; the rule and the driver are the reference's (``oasr.ctc.config.settle_rows`` /
``decode_bounded``), applied through ``_beam_rows`` / ``_restore_rows``: a host round trip at
most once per ``L - commit_at`` frames of a stream, none in a call that fits.

Slot ``w`` of a row holds the rank-``w`` prefix; a slot is *live* when
``logaddexp(log_pb, log_pnb) > -inf``, and live slots come first. Between
calls a dead slot holds the empty record (length 0, all padding). The buffers
are allocated once (``create_state``) and overwritten in place at the end of
every chunk; a chunk is computed on temporaries and committed only when it
succeeded, so a failed call leaves the state unchanged.

Token window: a frame appends at most one token, so a chunk of ``T`` frames
never touches token positions at or past ``longest + T`` (``longest``: the
longest stored prefix). ``decode_chunks`` works on that window of ``tokens`` /
``frames`` only, which keeps the per-frame gathers proportional to the
hypotheses' length rather than to ``max_prefix_len``::

    position:  0 1 2 ... longest-1 | longest ... longest+T-1 | ... max_prefix_len-1
               [ stored prefixes  ][ this chunk may append   ][ padding, untouched ]

The batched search's frame step and its rolling hash are drawn in ``oasr.fast.ctc_search``.

Host reads (batched path): one per ``decode_chunks`` call, whatever its number
of frames. The frame loop is torch ops only: the beam cut is taken without asking the host
about ties (``_ranked_top``), and the input check (NaN / ``+inf``), the
prefix-length check and each row's longest prefix (the next call's token
window, kept on the host as ``CtcBeamState.longest``) come back together in
one small read after the last frame, before anything is committed, so a
failed call still changes nothing. ``peek`` and ``finalize_stream`` read the
hypotheses back in one copy each.

Two paths, chosen by size (``StreamingCtcDecoder(host_loop_max_work=...)``)::

    batched    the tensor search above; any device; its cost per frame is a fixed ~80 torch ops,
               nearly independent of the cohort
    host loop  CPU states only, when rows * beam_size * (1 + candidates) <= host_loop_max_work
               (default HOST_LOOP_MAX_WORK): the candidates come from the same torch top-k per
               chunk, then a Python loop over rows x beams x candidates per frame, merging by
               token tuple. On a CPU it beats ~80 torch ops per frame for tiny cohorts (1 stream
               at beam 4: several times faster), and loses to them for large ones.

A third, ``cuda_graphs=True`` (CUDA states; what an engine with graphs on uses): the batched
search of a whole chunk (``search_chunk``) replayed as one CUDA graph per (width bucket, frames),
no per-frame host work (``oasr.fast.ctc_graph``).

Both paths keep the same state layout (the host loop stores the same keys,
padding and dead-slot records) and agree with the reference (the tests run
every case on both); the host loop reads the CPU state directly, which is
only memory, never a device synchronisation. The choice is made per call
from host-known sizes, and reported once (INFO, ``oasr.fast``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from oasr.ctc.config import (
    BeamEntry,
    BeamSnapshot,
    CtcDecoderConfig,
    CtcHypothesis,
    check_cohort,
    check_log_probs,
    check_snapshot,
    check_state_shape,
    committed_rows,
    decode_bounded,
    pack_committed,
    settle_rows,
    values_error,
)
from oasr.fast.ctc_search import (
    NEG_INF,
    _advance_host,
    _allocate,
    _Beams,
    _Candidates,
    _chunk_candidates,
    _fill_initial,
    _key_of,
    _logaddexp,
    search_chunk,
)

# Default of ``StreamingCtcDecoder(host_loop_max_work=)``: on a CPU, a cohort doing at most this
# many (row, beam, candidate) updates per frame runs the host loop (measured on a 2-core CPU:
# 1 stream at beam 4 or 10, and up to 4 streams at beam 4, with top-k = beam).
HOST_LOOP_MAX_WORK = 110
_logger = logging.getLogger("oasr.fast")
_reported: set = set()


@dataclass
class CtcBeamState:
    """Preallocated beam tensors for up to ``capacity`` rows; ``batch`` of them in use.

    ``reset_state`` to a batch no larger than ``capacity`` reuses the buffers;
    a larger batch reallocates them. ``frames_decoded`` is the absolute index
    of the stream's next frame. ``longest`` is the longest prefix any row
    holds, a host copy kept by the decoder (so the token window needs no read).
    ``committed[b]``: row ``b``'s committed ``(tokens, frames)`` lists, on the host
    (``oasr.ctc.config``, "Committed prefix").
    """

    config: CtcDecoderConfig
    batch: int
    vocab_size: int
    frames_decoded: int
    buffers: _Beams
    longest: int = 0
    committed: list = None
    native_ptrs: tuple = field(default=None, repr=False, compare=False)  # oasr.fast.ctc_native's cache

    @property
    def capacity(self) -> int:
        """Beam entries the state's buffers hold."""
        return self.buffers.tokens.shape[0]

    @property
    def device(self) -> torch.device:
        """The device of the state's buffers."""
        return self.buffers.tokens.device

    def rows(self) -> _Beams:
        """Views of the ``batch`` rows in use."""
        return _Beams(*(t[: self.batch] for t in self.buffers))


class StreamingCtcDecoder:
    """Fast CTC prefix beam search; same API as the reference, states are tensors on ``device``.

    ``decode_chunks`` is the cohort entry point: the rows of several states
    are stacked and decoded in one pass per frame (one copy in and out per
    call), which is how an engine should step many streams at once. The chunks
    may have different lengths: they are padded to the longest, and a row past
    its own length keeps its beams (a per-row length mask).

    ``host_loop_max_work`` picks the path by size (module docstring): CPU
    cohorts with ``rows * beam_size * (1 + candidates)`` at most this run the
    host loop, larger ones (and every CUDA cohort) the batched search; 0 turns
    the host loop off. Both give the same results. ``cuda_graphs=True`` (CUDA
    states) replays each chunk's whole search as one CUDA graph instead
    (``oasr.fast.ctc_graph``; ``graph_capture``: a capture-strategy factory,
    tests only); ``execution`` names the path.
    """

    def __init__(
        self,
        config: CtcDecoderConfig | None = None,
        device: torch.device | str = "cpu",
        host_loop_max_work: int = HOST_LOOP_MAX_WORK,
        cuda_graphs: bool = False,
        graph_capture=None,
        native: bool | str = "auto",
    ):
        self.config = config if config is not None else CtcDecoderConfig()
        if not isinstance(self.config, CtcDecoderConfig):
            raise TypeError(f"StreamingCtcDecoder: config must be a CtcDecoderConfig, got {self.config!r}")
        if isinstance(host_loop_max_work, bool) or not isinstance(host_loop_max_work, int) or host_loop_max_work < 0:
            raise ValueError(f"StreamingCtcDecoder: host_loop_max_work must be an int >= 0, got {host_loop_max_work!r}")
        self.device = torch.device(device)
        self.host_loop_max_work = host_loop_max_work
        self._all_tokens: dict[tuple[int, str], torch.Tensor] = {}
        if cuda_graphs not in (True, False):
            raise ValueError(f"StreamingCtcDecoder: cuda_graphs must be True or False, got {cuda_graphs!r}")
        if cuda_graphs and self.device.type != "cuda" and graph_capture is None:
            raise ValueError(f"StreamingCtcDecoder: cuda_graphs=True needs a CUDA device, got {self.device}; "
                             "on the CPU the search runs eager (cuda_graphs=False)")
        self.graphs = None
        if cuda_graphs:
            from oasr.fast.ctc_graph import ChunkSearchGraphs

            self.graphs = ChunkSearchGraphs(self, graph_capture)
        if native not in (True, False, "auto"):
            raise ValueError(f"StreamingCtcDecoder: native must be True, False or 'auto', got {native!r}")
        self.native = False
        if native is not False and self.device.type == "cpu" and not cuda_graphs:
            from oasr.fast import ctc_native

            reason = ctc_native.unavailable_reason()
            if reason is not None and native is True:
                raise RuntimeError(f"StreamingCtcDecoder(native=True): {reason}")
            self.native = reason is None
        elif native is True:
            raise ValueError(f"StreamingCtcDecoder: native=True runs CPU states only, got {self.device}")
        self.execution = ("graphed" if cuda_graphs else "batched" if self.device.type == "cuda"
                          else "native (C++)" if self.native else "host loop or batched, by size")
        if ("graphs", str(self.device)) not in _reported and cuda_graphs:
            _reported.add(("graphs", str(self.device)))
            _logger.info("oasr.fast: CTC decoder on %s: each chunk's search replays one CUDA graph per (width "
                         "bucket, frames); no per-frame host work", self.device)
        if host_loop_max_work not in _reported:
            _reported.add(host_loop_max_work)
            _logger.info(
                "oasr.fast: CTC decoder: CPU cohorts with rows*beam*(1+candidates) <= %d use the host loop, "
                "larger ones (and CUDA) the batched torch search", host_loop_max_work,
            )

    # ---- state lifecycle ----------------------------------------------------
    def create_state(self, batch: int, vocab_size: int) -> CtcBeamState:
        """Allocate the beam tensors for ``batch`` rows and fill them as a fresh stream."""
        check_state_shape("create_state", self.config, batch, vocab_size)
        buffers = _allocate(batch, self.config, self.device)
        _fill_initial(buffers)
        return CtcBeamState(self.config, batch, vocab_size, 0, buffers, 0, [([], []) for _ in range(batch)])

    def reset_state(self, state: CtcBeamState, batch: int, vocab_size: int) -> None:
        """Overwrite ``state`` in place so it decodes exactly as ``create_state(batch, vocab_size)``.

        Every buffer of the rows in use is rewritten, so whatever a previous
        stream (or a test's poison) left there cannot leak into the next one.
        """
        self._check_state(state, "reset_state")
        check_state_shape("reset_state", self.config, batch, vocab_size)
        if batch > state.capacity:
            state.buffers = _allocate(batch, self.config, state.device)
        state.batch, state.vocab_size, state.frames_decoded, state.longest = batch, vocab_size, 0, 0
        state.committed = [([], []) for _ in range(batch)]
        _fill_initial(state.rows())

    def snapshot_state(self, state: CtcBeamState) -> BeamSnapshot:
        """The state as a twin-neutral ``BeamSnapshot``: each row's live slots, in slot (rank) order."""
        self._check_state(state, "snapshot_state")
        return BeamSnapshot(state.batch, state.vocab_size, state.frames_decoded, self._beam_rows(state),
                            pack_committed(state.committed))

    @staticmethod
    def _beam_rows(state: CtcBeamState) -> tuple:
        """Each row's live slots as ``BeamEntry`` records (one read of the first ``longest`` positions)."""
        r, Lw = state.rows(), state.longest
        score = torch.logaddexp(r.log_pb, r.log_pnb).cpu().tolist()
        pb, pnb = r.log_pb.cpu().tolist(), r.log_pnb.cpu().tolist()
        lengths = r.lengths.cpu().tolist()
        tokens, frames = r.tokens[:, :, :Lw].cpu().tolist(), r.frames[:, :, :Lw].cpu().tolist()
        return tuple(
            tuple(
                BeamEntry(tuple(tokens[b][w][:n]), tuple(frames[b][w][:n]), pb[b][w], pnb[b][w])
                for w, n in enumerate(lengths[b])
                if score[b][w] > NEG_INF
            )
            for b in range(state.batch)
        )

    def restore_state(self, state: CtcBeamState, snapshot: BeamSnapshot) -> None:
        """Overwrite ``state`` in place so it decodes exactly as the state ``snapshot`` was taken from.

        The tensors are rebuilt in the layout of the module docstring: live slots first with
        their rolling-hash keys recomputed from the tokens, dead slots the empty record. A
        snapshot from either twin is accepted; it is validated first and on an error ``state``
        is unchanged.
        """
        self._check_state(state, "restore_state")
        check_snapshot("restore_state", self.config, snapshot)
        if snapshot.batch > state.capacity:
            state.buffers = _allocate(snapshot.batch, self.config, state.device)
        state.batch, state.vocab_size = snapshot.batch, snapshot.vocab_size
        state.frames_decoded = snapshot.frames_decoded
        state.committed = [([int(x) for x in t], [int(x) for x in f]) for t, f in committed_rows(snapshot)]
        self._restore_rows(state, snapshot.rows)

    def _restore_rows(self, state: CtcBeamState, rows) -> None:
        """Write ``rows`` (``BeamSnapshot.rows``, ``state.batch`` of them) into the state's buffers."""
        host = _allocate(len(rows), self.config, "cpu")
        _fill_initial(host)
        host.log_pb[:, 0] = NEG_INF
        for b, row in enumerate(rows):
            for w, e in enumerate(row):
                n = len(e.tokens)
                host.tokens[b, w, :n] = torch.tensor(e.tokens, dtype=torch.int32)
                host.frames[b, w, :n] = torch.tensor(e.frames, dtype=torch.int32)
                host.lengths[b, w] = n
                host.keys[b, w] = _key_of(e.tokens)
                host.parent_keys[b, w] = _key_of(e.tokens[:-1]) if n else -1
                host.last[b, w] = e.tokens[-1] if n else -1
                host.log_pb[b, w], host.log_pnb[b, w] = float(e.log_pb), float(e.log_pnb)
        state.longest = max((len(e.tokens) for row in rows for e in row), default=0)
        for buf, new in zip(state.rows(), host, strict=True):
            buf.copy_(new)

    # ---- decoding -----------------------------------------------------------
    def decode_chunk(self, state: CtcBeamState, log_probs: torch.Tensor) -> None:
        """Consume a chunk ``(batch, T, vocab)`` of log-probabilities (``T`` may be 0)."""
        self.decode_chunks([state], [log_probs])

    def decode_chunks(self, states: list[CtcBeamState], log_probs_list: list[torch.Tensor]) -> None:
        """Consume one chunk per state in a single batched pass; all states commit or none do.

        Chunks may differ in length ``T`` (0 included) but share the vocabulary
        and the device; inputs are moved to the states' device. One host read
        per call (module docstring).
        """
        self._decode(states, log_probs_list, "decode_chunk")

    def step(self, state: CtcBeamState, log_probs_frame: torch.Tensor) -> None:
        """Consume one frame ``(batch, vocab)``: ``decode_chunk`` with ``T = 1``."""
        self._check_state(state, "step")
        check_log_probs("step", log_probs_frame, state.batch, state.vocab_size, frame_dim=False, check_values=False)
        self._decode([state], [log_probs_frame.unsqueeze(1)], "step")

    def uses_host_loop(self, rows: int, vocab_size: int, device: torch.device | str | None = None) -> bool:
        """Whether a cohort of ``rows`` rows over ``vocab_size`` tokens on ``device`` takes the host loop."""
        device = torch.device(device) if device is not None else self.device
        work = rows * self.config.beam_size * (1 + self.config.num_candidates(vocab_size))
        return device.type == "cpu" and work <= self.host_loop_max_work

    def _decode(self, states: list[CtcBeamState], log_probs_list: list[torch.Tensor], where: str) -> None:
        self._check_cohort(states, log_probs_list)
        # long chunks in pieces, shared prefixes committed: the reference's driver (oasr.ctc.config)
        decode_bounded(self.config, states, log_probs_list, lambda s: s.longest, self._settle,
                       lambda ss, chunks: self._decode_fitting(ss, chunks, where),
                       lambda chunks: self._check_values(chunks, where))

    def _settle(self, state: CtcBeamState) -> None:
        """The commit rule through the host (rare: only when a call would outgrow ``max_prefix_len``)."""
        settled = settle_rows(self.config, self._beam_rows(state))
        if settled is not None:
            rows, additions = settled
            self._restore_rows(state, rows)
            for (tokens, frames), (t, f) in zip(state.committed, additions, strict=True):
                tokens.extend(t)
                frames.extend(f)

    @staticmethod
    def _check_values(chunks: list[torch.Tensor], where: str) -> None:
        if any(x.numel() and not bool(x.amax() < math.inf) for x in chunks):
            raise values_error(where)

    def _decode_fitting(self, states: list[CtcBeamState], log_probs_list: list[torch.Tensor], where: str) -> None:
        lengths = [x.shape[1] for x in log_probs_list]
        if max(lengths, default=0) == 0:
            return
        device = states[0].device
        lp = _stack_padded(log_probs_list, lengths, device)
        row_lengths = [n for state, n in zip(states, lengths, strict=True) for _ in range(state.batch)]
        if self.graphs is not None:
            self.graphs.decode(states, lp, row_lengths, where)
        elif self.native and device.type == "cpu":
            self._decode_native(states, lp, row_lengths, where)
        elif self.uses_host_loop(lp.shape[0], lp.shape[2], device):
            self._decode_host(states, lp, row_lengths, where)
        else:
            self._decode_batched(states, lp, row_lengths, where)
        for state, n in zip(states, lengths, strict=True):
            state.frames_decoded += n

    def _candidates(self, lp: torch.Tensor) -> _Candidates:
        V = lp.shape[2]
        all_tokens = self._all_tokens_for(V, lp.device) if self.config.num_candidates(V) == V - 1 else None
        return _chunk_candidates(lp, self.config, all_tokens)

    def _prefix_len_error(self) -> RuntimeError:
        return RuntimeError(
            "decode_chunk: a kept prefix would hold more than "
            f"CtcDecoderConfig.max_prefix_len={self.config.max_prefix_len} tokens; the state is unchanged"
        )

    def _decode_batched(self, states, lp: torch.Tensor, row_lengths: list[int], where: str) -> None:
        """The tensor search: torch ops per frame, one host read at the end, then commit."""
        device, T = lp.device, lp.shape[1]
        rows = [s.rows() for s in states]
        # Token window: every position at or past the longest stored prefix is padding, and a
        # frame adds at most one token, so this call touches only the first `window` positions.
        window = min(self.config.max_prefix_len, max(s.longest for s in states) + T)
        parts = [_Beams(r.tokens[:, :, :window], r.frames[:, :, :window], *r[2:]) for r in rows]
        beams = parts[0] if len(parts) == 1 else _Beams(*(torch.cat(p, 0) for p in zip(*parts, strict=True)))
        first_frame = torch.tensor(
            [s.frames_decoded for s in states for _ in range(s.batch)], dtype=torch.int64, device=device
        )
        mixed = len(set(row_lengths)) > 1
        row_len = torch.tensor(row_lengths, dtype=torch.int64, device=device) if mixed else None
        beams, header = search_chunk(beams, lp, first_frame, row_len, self.config, self._candidates)
        header = header.tolist()  # the one host read: input check, prefix-length check, longest prefixes
        if header[0]:
            raise values_error(where)
        if header[1]:
            raise self._prefix_len_error()
        start = 0
        for state, part in zip(states, parts, strict=True):
            for buf, new in zip(part, beams, strict=True):
                buf.copy_(new[start : start + state.batch])
            state.longest = max(header[2 + start : 2 + start + state.batch])
            start += state.batch

    def _decode_native(self, states, lp: torch.Tensor, row_lengths: list[int], where: str) -> None:
        """The native path (CPU states): candidates by torch, then one C call for every row and frame."""
        from oasr.fast import ctc_native

        if not bool(lp.amax() < math.inf):
            raise values_error(where)
        if not ctc_native.decode_rows(states, lp, row_lengths, self._candidates(lp), self.config):
            raise self._prefix_len_error()

    def _decode_host(self, states, lp: torch.Tensor, row_lengths: list[int], where: str) -> None:
        """The host loop (CPU states): candidates by torch, then Python per row and frame, then commit."""
        if not bool(lp.amax() < math.inf):
            raise values_error(where)
        cand = self._candidates(lp)
        cand_tokens, cand_lp = cand.tokens.tolist(), cand.lp_tokens.tolist()
        lp_blank = cand.lp_blank.tolist()
        lp_np = (lp if lp.dtype in (torch.float32, torch.float64) else lp.float()).numpy()
        W, limit = self.config.beam_size, self.config.max_prefix_len
        new_rows, r = [], 0
        for state in states:
            for beam in _read_beams(state):
                first = state.frames_decoded
                for t in range(row_lengths[r]):
                    frame = first + t
                    beam = _advance_host(beam, lp_np[r, t], lp_blank[r][t], cand_tokens[r][t], cand_lp[r][t], frame, W)
                new_rows.append(beam)
                r += 1
        longest = max((len(p[0]) for beam in new_rows for p in beam), default=0)
        if longest > limit:
            raise self._prefix_len_error()
        r = 0
        for state in states:
            _write_beams(state, new_rows[r : r + state.batch], max(longest, state.longest))
            r += state.batch

    # ---- results ----------------------------------------------------------------
    def peek(self, state: CtcBeamState) -> list[CtcHypothesis]:
        """The current best partial hypothesis of every row; ``CtcHypothesis([], -inf, [])`` if none."""
        self._check_state(state, "peek")
        return [row[0] if row else CtcHypothesis([], NEG_INF, []) for row in self._hypotheses(state, 1)]

    def peek_states(self, states: list[CtcBeamState]) -> list[list[CtcHypothesis]]:
        """``[peek(state) for state in states]`` read back in one copy for all of them: a cohort's partial
        results cost one device read, not one per stream. Per state a few views, then one ``cat`` per field."""
        for state in states:
            self._check_state(state, "peek_states")
        if not states:
            return []
        Lw = max(state.longest for state in states)  # positions at or past a state's longest hold padding

        def slot0(name: str, *window) -> torch.Tensor:  # every state's rows, beam slot 0, stacked
            return torch.cat([getattr(state.buffers, name)[(slice(state.batch), 0, *window)] for state in states])

        fields = [torch.logaddexp(slot0("log_pb"), slot0("log_pnb")).view(torch.int64), slot0("lengths"),
                  slot0("tokens", slice(Lw)).reshape(-1).long(), slot0("frames", slice(Lw)).reshape(-1).long()]
        packed = torch.cat(fields).cpu()
        R = fields[1].shape[0]
        score = packed[:R].view(torch.float64).tolist()
        lengths = packed[R : 2 * R].tolist()
        tokens = packed[2 * R : 2 * R + R * Lw].view(R, Lw).tolist()
        frames = packed[2 * R + R * Lw :].view(R, Lw).tolist()
        out, r = [], 0
        for state in states:
            rows = []
            for b in range(state.batch):
                ct, cf = state.committed[b]
                n = lengths[r]
                rows.append(CtcHypothesis(list(ct) + tokens[r][:n], score[r], list(cf) + frames[r][:n])
                            if score[r] > NEG_INF else CtcHypothesis([], NEG_INF, []))
                r += 1
            out.append(rows)
        return out

    def finalize_stream(self, state: CtcBeamState) -> list[list[CtcHypothesis]]:
        """Per row, the ``nbest`` best hypotheses, best first; reads the state, changes nothing."""
        self._check_state(state, "finalize_stream")
        return self._hypotheses(state, self.config.nbest)

    def _hypotheses(self, state: CtcBeamState, n: int) -> list[list[CtcHypothesis]]:
        """The first ``n`` slots of every row, read back in one copy (scores travel as their bits)."""
        rows, B, Lw = state.rows(), state.batch, state.longest
        score = torch.logaddexp(rows.log_pb[:, :n], rows.log_pnb[:, :n])
        packed = torch.cat([
            score.view(torch.int64).reshape(-1),
            rows.lengths[:, :n].reshape(-1),
            rows.tokens[:, :n, :Lw].reshape(-1).long(),
            rows.frames[:, :n, :Lw].reshape(-1).long(),
        ]).cpu()
        m = B * n
        score = packed[:m].view(torch.float64).view(B, n).tolist()
        lengths = packed[m : 2 * m].view(B, n).tolist()
        tokens = packed[2 * m : 2 * m + m * Lw].view(B, n, Lw).tolist()
        frames = packed[2 * m + m * Lw :].view(B, n, Lw).tolist()
        out = []
        for b in range(B):
            live = [w for w in range(n) if score[b][w] > NEG_INF]
            ct, cf = state.committed[b]
            out.append([CtcHypothesis(ct + tokens[b][w][: lengths[b][w]], score[b][w],
                                      cf + frames[b][w][: lengths[b][w]]) for w in live])
        return out

    # ---- validation -----------------------------------------------------------------
    def _all_tokens_for(self, vocab_size: int, device) -> torch.Tensor:
        key = (vocab_size, str(device))
        if key not in self._all_tokens:
            ids = torch.arange(vocab_size, device=device)
            self._all_tokens[key] = ids[ids != self.config.blank_id][None, :]
        return self._all_tokens[key]

    def _check_state(self, state, where: str) -> None:
        if not isinstance(state, CtcBeamState):
            raise TypeError(f"{where}: expected a fast CtcBeamState, got {type(state).__name__}")
        if state.config != self.config:
            raise ValueError(f"{where}: state was made for {state.config}, this decoder has {self.config}")

    def _check_cohort(self, states, log_probs_list) -> None:
        """Shapes and types (values are checked in the call's one read); one vocabulary, one device."""
        check_cohort(states, log_probs_list, self._check_state, check_values=False)
        if states:
            vocabs = {x.shape[2] for x in log_probs_list}
            devices = {s.device for s in states}
            if len(vocabs) > 1 or len(devices) > 1:
                raise ValueError(
                    "decode_chunks: a cohort needs one vocabulary and one device, got "
                    f"vocab {sorted(vocabs)} on {sorted(map(str, devices))}"
                )


def _stack_padded(log_probs_list: list[torch.Tensor], lengths: list[int], device) -> torch.Tensor:
    """The chunks stacked along rows on ``device``, each padded with zeros to the longest ``T``."""
    T = max(lengths)
    chunks = [x.detach().to(device) for x in log_probs_list]
    if all(n == T for n in lengths):
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks, 0)
    dtype = _common_dtype(chunks)
    R, V = sum(x.shape[0] for x in chunks), chunks[0].shape[2]
    lp = torch.zeros(R, T, V, dtype=dtype, device=device)
    start = 0
    for x, n in zip(chunks, lengths, strict=True):
        lp[start : start + x.shape[0], :n] = x
        start += x.shape[0]
    return lp


def _common_dtype(chunks: list[torch.Tensor]) -> torch.dtype:
    dtype = chunks[0].dtype
    for x in chunks[1:]:
        dtype = torch.promote_types(dtype, x.dtype)
    return dtype


def _read_beams(state: CtcBeamState) -> list[list[tuple]]:
    """A state's rows as host-loop prefixes (live slots only, in rank order)."""
    rows, Lw = state.rows(), state.longest
    tokens, frames = rows.tokens[:, :, :Lw].tolist(), rows.frames[:, :, :Lw].tolist()
    lengths, keys, parent_keys = rows.lengths.tolist(), rows.keys.tolist(), rows.parent_keys.tolist()
    log_pb, log_pnb = rows.log_pb.tolist(), rows.log_pnb.tolist()
    beams = []
    for b in range(state.batch):
        beam = []
        for w in range(len(lengths[b])):
            pb, pnb = log_pb[b][w], log_pnb[b][w]
            if _logaddexp(pb, pnb) > NEG_INF:
                n = lengths[b][w]
                beam.append((tuple(tokens[b][w][:n]), tuple(frames[b][w][:n]), pb, pnb, keys[b][w], parent_keys[b][w]))
        beams.append(beam)
    return beams


def _write_beams(state: CtcBeamState, beams: list[list[tuple]], window: int) -> None:
    """Store host-loop beams in the state's layout (dead slots: the empty record); sets ``longest``."""
    W = state.config.beam_size
    pad = (), (), NEG_INF, NEG_INF, 0, -1
    tokens, frames, scalars = [], [], []
    for beam in beams:
        beam = beam + [pad] * (W - len(beam))
        tokens.append([list(p[0]) + [-1] * (window - len(p[0])) for p in beam])
        frames.append([list(p[1]) + [-1] * (window - len(p[1])) for p in beam])
        scalars.append([(len(p[0]), p[4], p[5], p[0][-1] if p[0] else -1) for p in beam])
    rows = state.rows()
    rows.tokens[:, :, :window].copy_(torch.tensor(tokens, dtype=torch.int32).view(state.batch, W, window))
    rows.frames[:, :, :window].copy_(torch.tensor(frames, dtype=torch.int32).view(state.batch, W, window))
    ints = torch.tensor(scalars, dtype=torch.int64)  # (B, W, 4): length, key, parent key, last
    rows.lengths.copy_(ints[..., 0])
    rows.keys.copy_(ints[..., 1])
    rows.parent_keys.copy_(ints[..., 2])
    rows.last.copy_(ints[..., 3])
    rows.log_pb.copy_(torch.tensor([[p[2] for p in beam] + [NEG_INF] * (W - len(beam)) for beam in beams],
                                   dtype=torch.float64))
    rows.log_pnb.copy_(torch.tensor([[p[3] for p in beam] + [NEG_INF] * (W - len(beam)) for beam in beams],
                                    dtype=torch.float64))
    state.longest = max((len(p[0]) for beam in beams for p in beam), default=0)
