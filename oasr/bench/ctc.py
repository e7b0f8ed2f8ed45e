"""Bench section: streaming CTC prefix beam search, reference against fast.

A case is a cohort of ``streams`` streams (one state of batch 1 each, as the
engine holds them) decoded together with ``decode_chunks``, at beam 4 and 10
and vocabulary 500 and 5000. Per-frame pruning is ``token_topk = beam_size``
(the usual production setting; without it every frame extends every beam by
every token). Posteriors are synthetic but CTC-shaped: about 70% of the frames
are blank-dominated, the rest peak on a random token.

Columns: ``reference_ms`` / ``fast_ms`` are median milliseconds to advance the
whole cohort by one frame; ``frames_per_s_*`` count stream-frames per second
(``streams * 1000 / ms``). The reference is slow at large cohorts, so it is
timed on a few frames only (``ref_frames``); every figure is per frame, so the
two columns stay comparable. Each repeat starts from freshly reset states, so
prefixes are short: this measures the search, not long-stream token copying.
The fast twin runs on CUDA when one is available (``fast_device``), else on the
CPU; the reference always runs on the CPU.
"""

from __future__ import annotations

import statistics

import torch

from oasr.bench import clock, sync
from oasr.ctc.config import CtcDecoderConfig
from oasr.fast.ctc_decoder import StreamingCtcDecoder as FastDecoder
from oasr.reference.ctc_decoder import StreamingCtcDecoder as ReferenceDecoder

FULL_GRID = [(s, b, v) for s in (1, 8, 32, 128) for b in (4, 10) for v in (500, 5000)]
QUICK_GRID = [(1, 4, 500), (1, 10, 5000), (8, 4, 500), (32, 10, 500), (8, 10, 5000)]
NOTES = (
    "the fast twin picks its path by size (StreamingCtcDecoder.uses_host_loop; column fast_path): on a CPU, "
    "cohorts with rows*beam*(1+candidates) <= host_loop_max_work run the host loop, larger ones the batched search"
)
CPU = torch.device("cpu")


def ctc_posteriors(streams: int, frames: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """``(streams, frames, vocab)`` float32 log-probabilities shaped like a CTC model's output."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(streams, frames, vocab, generator=g)
    peak = torch.randint(1, vocab, (streams, frames), generator=g)
    peak[torch.rand(streams, frames, generator=g) < 0.7] = 0  # blank
    logits.scatter_add_(2, peak[:, :, None], torch.full((streams, frames, 1), 8.0))
    return logits.log_softmax(-1)


def _ms_per_frame(decoder, lp: torch.Tensor, repeats: int, device: torch.device = CPU) -> float:
    """Median over ``repeats`` of (time to decode ``lp`` from reset states) / frames."""
    streams, frames, vocab = lp.shape
    states = [decoder.create_state(1, vocab) for _ in range(streams)]
    chunks = [lp[s : s + 1].to(device) for s in range(streams)]
    times = []
    now = clock(device)
    for i in range(repeats + 1):  # the first run warms up and is dropped
        for state in states:
            decoder.reset_state(state, 1, vocab)
        sync(device)
        start = now()
        decoder.decode_chunks(states, chunks)
        sync(device)
        if i:
            times.append((now() - start) * 1e3 / frames)
    return statistics.median(times)


def section(quick: bool) -> list[dict]:
    """Rows for the lead's harness; ``quick`` runs a four-case grid in a few seconds."""
    grid = QUICK_GRID if quick else FULL_GRID
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the fast twin's; reference: CPU
    repeats = 3 if quick else 5
    rows = []
    for streams, beam, vocab in grid:
        config = CtcDecoderConfig(beam_size=beam, token_topk=beam)
        fast_frames = 16 if quick else 32
        # keep the reference's Python work per repeat roughly constant: fewer frames for big cohorts
        ref_frames = max(2, min(fast_frames, 256 // streams))
        lp = ctc_posteriors(streams, fast_frames, vocab)
        ref_ms = _ms_per_frame(ReferenceDecoder(config), lp[:, :ref_frames], repeats)
        fast = FastDecoder(config, device=device)
        fast_ms = _ms_per_frame(fast, lp, repeats, device)
        rows.append(
            {
                "section": "ctc",
                "case": f"streams={streams} beam={beam} vocab={vocab} topk={beam}",
                "reference_ms": ref_ms,
                "fast_ms": fast_ms,
                "frames_per_s_reference": streams * 1e3 / ref_ms,
                "frames_per_s_fast": streams * 1e3 / fast_ms,
                "ref_frames": ref_frames,
                "fast_device": device.type,
                "fast_path": "host loop" if fast.uses_host_loop(streams, vocab) else "batched",
            }
        )
    return rows


if __name__ == "__main__":
    import sys

    for row in section(quick="--full" not in sys.argv):
        print(
            f"{row['case']:45s} ref {row['reference_ms']:9.3f} ms  fast {row['fast_ms']:8.3f} ms  "
            f"x{row['reference_ms'] / row['fast_ms']:6.1f}  ({row['frames_per_s_fast']:.0f} frames/s fast)"
        )
