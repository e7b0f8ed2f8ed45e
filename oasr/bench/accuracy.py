"""What the cache choices cost in recognition: word error rate against K/V bytes per stream.

Every row transcribes the shipped held-out clips (sentences and voices never trained on) through the
engine with one configuration and reports its WER and CER beside the K/V memory it holds per stream.
The grid: the left-context window (1, 2, 4, 8 chunks, unlimited) in the model dtype and in fp8 pages,
with and without attention rescoring, the full-context (non-streaming) ceiling, and the default
configuration on both twins. K/V bytes per stream are counted from the geometry: a stream holds
``min(its encoder frames, (left + 1) * chunk)`` frames at its end, times the bytes one frame takes in
every layer's pages (fp8: one byte per value plus a 4-byte scale per head vector), averaged over clips.
"""

from __future__ import annotations

import time

from oasr.asr.checkpoint import serving_chunking
from oasr.asr.testset import load_testset

WINDOWS = (1, 2, 4, 8, -1)
NOTES = ("WER in % on the shipped held-out set; kv_bytes: mean K/V bytes a stream holds at its end; "
         "rtf: wall seconds per second of audio in this process (1 thread)")


def kv_bytes_per_stream(rec, clips_frames: list[int]) -> float:
    """Mean K/V bytes a stream of ``rec``'s cache config holds at its end, over clips of ``clips_frames`` frames."""
    from oasr.cache.memory import bytes_per_kv_block

    cfg = rec.cache_config
    per_frame = bytes_per_kv_block(cfg) / cfg.block_size_frames
    window = None if cfg.num_left_chunks < 0 else (cfg.num_left_chunks + 1) * cfg.chunk_size
    held = [n if window is None else min(n, window) for n in clips_frames]
    return per_frame * sum(held) / len(held)


def run(config: dict, clips, model_path=None) -> dict:
    """One row: transcribe ``clips`` under ``config`` (``Recognizer`` keyword arguments)."""
    from oasr.asr.evaluation import evaluate
    from oasr.asr.recognizer import Recognizer

    rec = Recognizer(model_path, **config)
    t0 = time.perf_counter()
    result = evaluate(rec, clips)
    frames = [int(_seconds(c) * 25) for c in clips]  # encoder frames: 100 fbank frames/s, subsampled 4x
    return {"wer": 100 * result["wer"], "cer": 100 * result["cer"], "first_pass_wer": 100 * result["first_pass_wer"],
            "kv_bytes": 0.0 if config.get("full_context") else kv_bytes_per_stream(rec, frames),
            "rtf": (time.perf_counter() - t0) / result["audio_seconds"],
            "texts": [h["hyp"] for h in result["hypotheses"]]}


def _seconds(clip) -> float:
    import soundfile as sf

    return sf.info(str(clip.path)).duration


def _left_name(left: int) -> str:
    return f"left {'all' if left < 0 else left}"


def grid(quick: bool, left: int | None = None) -> list[tuple[str, dict]]:
    """The ``(case name, config)`` pairs this section runs (``quick``: fewer left-context windows); the
    rescored and reference-twin rows run at ``left`` (default: the shipped model's serving window)."""
    left = serving_chunking()[1] if left is None else left
    windows = WINDOWS if not quick else tuple(sorted({1, left, -1}, key=lambda w: (w < 0, w)))
    cases = []
    for kv in (None, "fp8_e4m3"):
        for w in windows:
            cases.append((f"{_left_name(w)}, {kv or 'model dtype'}", {"num_left_chunks": w, "kv_cache_dtype": kv}))
    cases.append((f"{_left_name(left)}, model dtype, rescored", {"num_left_chunks": left, "rescore": True}))
    cases.append((f"{_left_name(left)}, fp8_e4m3, rescored",
                  {"num_left_chunks": left, "kv_cache_dtype": "fp8_e4m3", "rescore": True}))
    cases.append(("full context", {"full_context": True}))
    cases.append(("full context, rescored", {"full_context": True, "rescore": True}))
    cases.append((f"{_left_name(left)}, model dtype, reference twin", {"num_left_chunks": left, "twin": "reference"}))
    return cases


def section(quick: bool, device: str = "cpu") -> list[dict]:
    """This section's rows (``quick``: the first 24 clips, the reduced grid) on ``device``; see the module docstring."""
    clips = load_testset(limit=24 if quick else None)
    rows, texts, left = [], {}, serving_chunking()[1]
    for name, config in grid(quick, left):
        row = run({**config, "device": device}, clips)
        texts[name] = row.pop("texts")
        rows.append({"section": "accuracy", "case": name, "clips": len(clips), **row})
    same = texts[f"{_left_name(left)}, model dtype"] == texts[f"{_left_name(left)}, model dtype, reference twin"]
    rows.append({"section": "accuracy", "case": f"twins give identical transcripts ({_left_name(left)})",
                 "clips": len(clips), "wer": None, "identical": same})
    return rows
